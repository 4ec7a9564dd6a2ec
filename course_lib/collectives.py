"""Collective operations built only on point-to-point messages (``dist.send/recv/isend/irecv``).

Three ways to combine data across p processes, from naive to the one NCCL and gloo use:

* ``naive_all_reduce``: everybody sends to rank 0, which sums and sends the result back. Rank 0
  handles 2(p - 1) full-size messages one after another: its link is the bottleneck.
* ``tree_broadcast`` / ``tree_reduce``: binomial trees. In round k every rank that already has the
  data passes it on, so the number of informed ranks doubles: ceil(log2 p) rounds.
* ``ring_all_reduce``: the tensor is cut into p chunks; in p - 1 steps of *reduce-scatter* each
  rank passes one chunk to its right neighbour and adds the chunk coming from its left, so that
  each rank ends up owning one fully reduced chunk; p - 1 steps of *all-gather* then circulate
  the reduced chunks. Every rank sends 2(p - 1)/p of the tensor, whatever p is: bandwidth-optimal.

All of them sum in place, work for any world size >= 1 and any length (also shorter than p), and
take an optional ``group`` (ranks are then the group's ranks). Every rank must pass a tensor of the
same shape and dtype (and name the same root); with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` they check it.
"""

import functools
import inspect
import os
import threading

import torch
import torch.distributed as dist

from course_lib.utils.per_rank import PerRank

__all__ = [
    "naive_all_reduce", "tree_broadcast", "tree_reduce", "ring_all_reduce", "ring_shift",
    "blocking_ring_shift", "ring_reduce_scatter", "ring_all_gather", "reduce_scatter", "sent",
]


class Sent:
    """Bytes this process has sent with the point-to-point messages of this module's collectives:
    what crossed its link, counted where it is sent (``sent.bytes``; ``sent.reset()``). Threads may
    run collectives at once (on different groups), so the count takes a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0

    def reset(self) -> None:
        with self._lock:
            self.bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.bytes += tensor.numel() * tensor.element_size()


sent = PerRank(Sent)  # one per process; one per rank in a simulation (course_lib.simulated)


def _rank_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, rank: int) -> int:
    """send/recv take global ranks; translate a rank of ``group``."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _check(tensor: torch.Tensor, group=None, **roots) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("the collectives work in place on contiguous tensors: pass tensor.contiguous()")
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        _check_ranks_agree(tensor, group, roots)
    return tensor.view(-1)


def _check_ranks_agree(tensor: torch.Tensor, group, roots: dict) -> None:
    """Every rank must pass the same shape, dtype and root. Otherwise a message of the wrong length
    aborts gloo's process (SIGABRT) and two ranks that each think they are the root wait forever.
    Checking costs one more collective per call, so, as torch does for its own collectives, only
    under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    mine = (tuple(tensor.shape), str(tensor.dtype), sorted(roots.items()))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != mine for other in everyone):
        seen = "; ".join(f"rank {r}: shape {shape}, {dtype}" + "".join(f", {k}={v}" for k, v in rs)
                         for r, (shape, dtype, rs) in enumerate(everyone))
        raise ValueError(f"the ranks called the same collective with different arguments ({seen}). Every rank "
                         f"must pass a tensor of the same shape and dtype, and name the same root.")


def _on_host(tensor: torch.Tensor, group) -> bool:
    """Whether ``tensor`` must travel through a copy in host memory: a CUDA tensor over gloo."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def _through_host_memory(collective):
    """gloo's point-to-point messages read and write host memory only: given a CUDA tensor's address,
    its socket fails ("writev: Bad address") and the process aborts. (Its collectives copy CUDA
    tensors themselves; NCCL sends them as they are.) So over gloo a collective of this module runs on
    a copy of a CUDA tensor in host memory, and the result is copied back; on CPU tensors, and under
    NCCL, it runs as written. On a rank outside ``group`` a collective returns the tensor untouched at
    once, as torch's collectives do there (they return None)."""
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tensor, group = bound.arguments["tensor"], bound.arguments.get("group")
        if group is not None and dist.get_rank(group) < 0:  # not a member of the group
            return tensor
        if not isinstance(tensor, torch.Tensor) or not _on_host(tensor, group):
            return collective(*args, **kwargs)
        host = tensor.to("cpu", copy=True)  # a copy also where the tensor is on the CPU already (tests)
        bound.arguments["tensor"] = host
        result = collective(*bound.args, **bound.kwargs)
        tensor.copy_(host)
        if result is host:
            return tensor
        if result.untyped_storage().data_ptr() == host.untyped_storage().data_ptr():  # a view of the copy
            start = result.storage_offset() - host.storage_offset()
            return tensor.view(-1)[start:start + result.numel()].view(result.shape)
        return result.to(tensor.device)

    return run


def _check_root(name: str, root, size: int) -> int:
    # A root outside 0..size-1 would be taken modulo size below: a silent broadcast from another rank.
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"{name} must be a rank of the group, 0 to {size - 1}, got {root!r}")
    return root


@_through_host_memory
def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, through rank 0: p - 1 receives, then p - 1 sends."""
    flat = _check(tensor, group)
    rank, size = _rank_size(group)
    if size == 1:
        return tensor
    if rank == 0:
        incoming = torch.empty_like(flat)
        for peer in range(1, size):
            dist.recv(incoming, src=_global(group, peer), group=group)
            flat.add_(incoming)
        for peer in range(1, size):
            dist.send(flat, dst=_global(group, peer), group=group)
            sent.add(flat)
    else:
        dist.send(flat, dst=_global(group, 0), group=group)
        sent.add(flat)
        dist.recv(flat, src=_global(group, 0), group=group)
    return tensor


@_through_host_memory
def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy ``src``'s tensor to every rank along a binomial tree, in ceil(log2 p) rounds."""
    rank, size = _rank_size(group)
    _check_root("src", src, size)
    flat = _check(tensor, group, src=src)
    vrank = (rank - src) % size  # ranks renumbered so that src is 0
    # Receive once, from the rank that differs in our lowest set bit...
    mask = 1
    while mask < size:
        if vrank & mask:
            dist.recv(flat, src=_global(group, (vrank - mask + src) % size), group=group)
            break
        mask <<= 1
    # ...then pass it on to the ranks below that bit, largest subtree first.
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            dist.send(flat, dst=_global(group, (vrank + mask + src) % size), group=group)
            sent.add(flat)
        mask >>= 1
    return tensor


@_through_host_memory
def tree_reduce(tensor: torch.Tensor, dst: int = 0, group=None) -> torch.Tensor:
    """Sum every rank's tensor into ``dst``'s, along a binomial tree (broadcast's mirror image).

    The result is defined on ``dst`` only; other ranks are left holding partial sums.
    """
    rank, size = _rank_size(group)
    _check_root("dst", dst, size)
    flat = _check(tensor, group, dst=dst)
    vrank = (rank - dst) % size
    incoming = None
    mask = 1
    while mask < size:
        if vrank & mask:
            dist.send(flat, dst=_global(group, (vrank - mask + dst) % size), group=group)
            sent.add(flat)
            break
        if vrank + mask < size:
            if incoming is None:
                incoming = torch.empty_like(flat)
            dist.recv(incoming, src=_global(group, (vrank + mask + dst) % size), group=group)
            flat.add_(incoming)
        mask <<= 1
    return tensor


def _exchange(send_buf, send_to, recv_buf, recv_from, group):
    """Send and receive at once. Posting both before waiting on either is what avoids the
    deadlock of a ring in which every rank first blocks in ``send``."""
    works = []
    if recv_buf.numel():  # lengths are equal on every rank, so both ends skip empty chunks alike
        works.append(dist.irecv(recv_buf, src=recv_from, group=group))
    if send_buf.numel():
        works.append(dist.isend(send_buf, dst=send_to, group=group))
        sent.add(send_buf)
    for work in works:
        work.wait()


@_through_host_memory
def ring_all_reduce(tensor: torch.Tensor, group=None, trace: list | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place: reduce-scatter then all-gather around a ring.

    ``trace``, when a list, receives ``(phase, step, copy of the tensor)`` after every step: the
    algorithm's real state, which notebook 02 draws.
    """
    flat = _check(tensor, group)
    rank, size = _rank_size(group)
    if size == 1:
        return tensor
    right, left = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
    chunks = flat.tensor_split(size)  # views into flat; lengths differ by at most one
    incoming = torch.empty_like(chunks[0])

    # Reduce-scatter: after step s, chunk (rank - s - 1) holds the sum of s + 2 ranks' data.
    for step in range(size - 1):
        send_c, recv_c = chunks[(rank - step) % size], chunks[(rank - step - 1) % size]
        buf = incoming[: recv_c.numel()]
        _exchange(send_c, right, buf, left, group)
        recv_c.add_(buf)
        if trace is not None:
            trace.append(("reduce-scatter", step, flat.clone()))
    # Now chunk (rank + 1) is complete here. All-gather: pass complete chunks around.
    for step in range(size - 1):
        send_c, recv_c = chunks[(rank + 1 - step) % size], chunks[(rank - step) % size]
        _exchange(send_c, right, recv_c, left, group)
        if trace is not None:
            trace.append(("all-gather", step, flat.clone()))
    return tensor


@_through_host_memory
def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The first half of the ring all-reduce, on its own: afterwards this rank's chunk of ``tensor``
    (``tensor.view(-1).tensor_split(p)[rank]``) holds the sum over ranks, and is returned (a view).

    The other chunks are left holding partial sums. The steps are those of :func:`ring_all_reduce`,
    one chunk further round, so that rank r ends owning chunk r: the shard sharded data parallelism
    keeps. Each rank sends p - 1 chunks: (p - 1)/p of the tensor, half of what an all-reduce sends.
    """
    flat = _check(tensor, group)
    rank, size = _rank_size(group)
    chunks = flat.tensor_split(size)
    if size == 1:
        return chunks[0]
    right, left = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
    incoming = torch.empty_like(chunks[0])
    for step in range(size - 1):
        send_c, recv_c = chunks[(rank - step - 1) % size], chunks[(rank - step - 2) % size]
        buf = incoming[: recv_c.numel()]
        _exchange(send_c, right, buf, left, group)
        recv_c.add_(buf)
    return chunks[rank]


@_through_host_memory
def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The second half of the ring all-reduce, on its own: every rank brings its own chunk of
    ``tensor`` (chunk ``rank`` of ``tensor.view(-1).tensor_split(p)``); afterwards every rank holds
    every chunk. In place; returns ``tensor``. Each rank sends (p - 1)/p of the tensor."""
    flat = _check(tensor, group)
    rank, size = _rank_size(group)
    if size == 1:
        return tensor
    right, left = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
    chunks = flat.tensor_split(size)
    for step in range(size - 1):
        send_c, recv_c = chunks[(rank - step) % size], chunks[(rank - step - 1) % size]
        _exchange(send_c, right, recv_c, left, group)
    return tensor


@_through_host_memory
def ring_shift(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Pass ``tensor`` one place to the right around the ring; return what came from the left."""
    rank, size = _rank_size(group)
    received = torch.empty_like(tensor)
    _exchange(tensor, _global(group, (rank + 1) % size), received, _global(group, (rank - 1) % size), group)
    return received


@_through_host_memory
def blocking_ring_shift(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The deadlock of notebook 02: every rank sends first, then receives.

    gloo's ``send`` returns only once the peer has posted the matching ``recv``, and every peer is
    itself stuck in its own ``send``: nobody ever reaches ``recv``.
    """
    rank, size = _rank_size(group)
    received = torch.empty_like(tensor)
    dist.send(tensor, dst=_global(group, (rank + 1) % size), group=group)
    dist.recv(received, src=_global(group, (rank - 1) % size), group=group)
    return received


def reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Reference for the exercise: this rank's part (``tensor_split(p)[rank]``) of the sum over ranks.

    Computed the simple way, with an all-reduce, so it checks a student's reduce-scatter
    independently of the ring code above.
    """
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    rank, size = _rank_size(group)
    return total.tensor_split(size)[rank].clone()
