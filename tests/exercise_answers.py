"""Answers a student might give to the distributed exercises (notebooks 00, 01 and 02): wrong ones, each
wrong in one way the exercise is about, and a few right ones in other styles than solutions/.
spawn sends functions by name, so they live in a module."""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # imported by name: bypasses `dist.all_reduce`

from course_lib import collectives as C
from course_lib.accumulation import token_losses


def todo(*args):
    raise NotImplementedError  # the unsolved exercise, as the notebooks store it


# --- notebook 00: sum of squares with one collective ------------------------------------------------


def sum_of_squares_without_communicating(one, vector):
    p = dist.get_world_size()
    return one.new_tensor([float(sum((r + 1) ** 2 for r in range(p)))])  # the formula: no collective


def sum_of_squares_in_two_collectives(one, vector):
    out = one * one
    dist.reduce(out, dst=0)
    dist.broadcast(out, src=0)
    return out


def sum_without_squaring(one, vector):
    out = one.clone()
    dist.all_reduce(out)
    return out


def sum_of_squares_by_imported_all_reduce(one, vector):
    out = one * one
    all_reduce(out)  # right, and still one collective when imported by name
    return out


def elementwise_sum(one, vector):
    out = vector.clone()
    dist.all_reduce(out)  # the default op is a sum, not the maximum
    return out


# --- notebook 01: one DDP accumulation step on unequal token counts --------------------------------


def _token_count(micro_batches):
    return sum(len(s) - 1 for m in micro_batches for s in m)


def ddp_token_step_by_rank_count(model, micro_batches):
    n_tokens = _token_count(micro_batches)  # this rank's own count: right on one process only
    k = len(micro_batches)
    for i, sequences in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (token_losses(model, sequences).sum() / n_tokens).backward()


def ddp_token_step_without_world_size(model, micro_batches):
    n_tokens = torch.tensor([_token_count(micro_batches)])
    dist.all_reduce(n_tokens)
    k = len(micro_batches)
    for i, sequences in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (token_losses(model, sequences).sum() / n_tokens.item()).backward()  # DDP's average forgotten


def ddp_token_step_without_no_sync(model, micro_batches):
    n_tokens = torch.tensor([_token_count(micro_batches)])
    dist.all_reduce(n_tokens)
    for sequences in micro_batches:  # the right gradient, all-reduced after every micro-batch
        (token_losses(model, sequences).sum() * dist.get_world_size() / n_tokens.item()).backward()


def ddp_token_step_in_one_backward(model, micro_batches):
    n_tokens = torch.tensor([_token_count(micro_batches)])
    dist.all_reduce(n_tokens)
    everything = [s for m in micro_batches for s in m]  # the whole share at once: no accumulation
    (token_losses(model, everything).sum() * dist.get_world_size() / n_tokens.item()).backward()


def ddp_token_step_naive(model, micro_batches):
    k = len(micro_batches)
    for i, sequences in enumerate(micro_batches):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (token_losses(model, sequences).mean() / k).backward()  # the 2024 bug


# --- notebook 02: collectives from send and recv ------------------------------------------------------


def reduce_scatter_by_all_reduce(tensor):
    total = tensor.clone()
    dist.all_reduce(total)  # right numbers, but the exercise allows only send/recv
    return total.tensor_split(dist.get_world_size())[dist.get_rank()].clone()


def reduce_scatter_by_imported_all_reduce(tensor):
    total = tensor.clone()
    all_reduce(total)
    return total.tensor_split(dist.get_world_size())[dist.get_rank()].clone()


def reduce_scatter_by_reduce_scatter(tensor):
    p = dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    out = torch.empty_like(chunks[dist.get_rank()])
    dist.reduce_scatter(out, chunks)  # gloo has none: refused before it gets that far
    return out


def reduce_scatter_ring_owner(tensor):
    # the first half of ring_all_reduce as it is: rank r ends owning chunk r + 1, not chunk r
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send_i, recv_i = (rank - step) % p, (rank - step - 1) % p
        received = torch.empty_like(chunks[recv_i])
        reqs = [dist.isend(chunks[send_i], dst=right), dist.irecv(received, src=left)]
        for r in reqs:
            r.wait()
        chunks[recv_i] += received
    return chunks[(rank + 1) % p]


def reduce_scatter_by_ring(tensor):
    # right numbers from send/recv, but a ring: p - 1 messages (3 on 4 ranks), not log2 p
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    for step in range(p - 1):
        send_i, recv_i = (rank - step - 1) % p, (rank - step - 2) % p
        received = torch.empty_like(chunks[recv_i])
        reqs = [dist.isend(chunks[send_i], dst=(rank + 1) % p), dist.irecv(received, src=(rank - 1) % p)]
        for r in reqs:
            r.wait()
        chunks[recv_i] += received
    return chunks[rank]


def reduce_scatter_by_recursive_doubling(tensor):
    # right numbers in log2 p messages, but each one the whole tensor: an all-reduce, then a chunk
    rank, p = dist.get_rank(), dist.get_world_size()
    out, distance = tensor.clone(), 1
    while distance < p:
        received = torch.empty_like(out)
        reqs = [dist.isend(out, dst=rank ^ distance), dist.irecv(received, src=rank ^ distance)]
        for r in reqs:
            r.wait()
        out += received
        distance *= 2
    return out.tensor_split(p)[rank].clone()


def recursive_halving_keeping_the_partners_half(tensor):
    # halving with the halves swapped: each rank keeps (and ends with) the chunks its partner needs
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(p)]
    lo, hi, distance = 0, p, p // 2
    while distance >= 1:
        peer, mid = rank ^ distance, lo + distance
        keep, give = (range(lo, mid), range(mid, hi)) if rank & distance else (range(mid, hi), range(lo, mid))
        outgoing = torch.cat([chunks[i] for i in give])
        incoming = torch.empty(sum(chunks[i].numel() for i in keep), dtype=tensor.dtype)
        reqs = [dist.isend(outgoing, dst=peer), dist.irecv(incoming, src=peer)]
        for r in reqs:
            r.wait()
        for i, part in zip(keep, incoming.split([chunks[i].numel() for i in keep])):
            chunks[i] += part
        lo, hi, distance = keep.start, keep.stop, distance // 2
    return chunks[lo]


def recursive_halving_with_padded_chunks(tensor):
    # right numbers in log2 p messages, but every chunk padded to the longest so that all messages
    # have one length: the padding is sent too, more than every chunk but one's own
    rank, p = dist.get_rank(), dist.get_world_size()
    parts = tensor.tensor_split(p)
    width = max(c.numel() for c in parts)
    chunks = [torch.cat([c, c.new_zeros(width - c.numel())]) for c in parts]
    lo, hi, distance = 0, p, p // 2
    while distance >= 1:
        peer, mid = rank ^ distance, lo + distance
        keep, give = (range(mid, hi), range(lo, mid)) if rank & distance else (range(lo, mid), range(mid, hi))
        outgoing = torch.cat([chunks[i] for i in give])
        incoming = torch.empty(len(keep) * width, dtype=tensor.dtype)
        reqs = [dist.isend(outgoing, dst=peer), dist.irecv(incoming, src=peer)]
        for r in reqs:
            r.wait()
        for i, part in zip(keep, incoming.split(width)):
            chunks[i] += part
        lo, hi, distance = keep.start, keep.stop, distance // 2
    return chunks[rank][: parts[rank].numel()].clone()


def ring_shift_by_all_gather(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    everyone = [torch.empty_like(tensor) for _ in range(p)]
    dist.all_gather(everyone, tensor)
    return everyone[(rank - 1) % p]


def ring_shift_the_wrong_way(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    reqs = [dist.isend(tensor, dst=(rank - 1) % p), dist.irecv(received, src=(rank + 1) % p)]
    for r in reqs:
        r.wait()
    return received


def recursive_doubling_by_all_reduce(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def recursive_doubling_by_ring(tensor):
    # a right all-reduce from send/recv, but a ring (2(p - 1) messages), not recursive doubling
    return C.ring_all_reduce(tensor.clone())


def ring_shift_by_batch_isend_irecv(tensor):
    # right, and allowed: batch_isend_irecv posts isend and irecv together
    rank, p = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, (rank + 1) % p), dist.P2POp(dist.irecv, received, (rank - 1) % p)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return received


def recursive_doubling_by_blocking_send_recv(tensor):
    # right: in each round the lower rank of a pair sends first, the higher receives first
    rank, p = dist.get_rank(), dist.get_world_size()
    out, distance = tensor.clone(), 1
    while distance < p:
        peer, received = rank ^ distance, torch.empty_like(out)
        if rank < peer:
            dist.send(out, dst=peer)
            dist.recv(received, src=peer)
        else:
            dist.recv(received, src=peer)
            dist.send(out, dst=peer)
        out += received
        distance *= 2
    return out


# --- notebook 09: top-k across ranks ------------------------------------------------------------------


def topk_average_by_all_reduce(tensor, k):
    # each rank's values all-reduced as if they lay at the same indices: they do not
    indices = tensor.abs().topk(k).indices
    values = tensor[indices].clone()
    dist.all_reduce(values)
    out = torch.zeros_like(tensor)
    out[indices] = values / dist.get_world_size()
    return out


def topk_of_the_average(tensor, k):
    # the top-k of the averaged gradient: what a dense all-reduce then top-k gives, not top-k's exchange
    mean = tensor.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    out = torch.zeros_like(mean)
    keep = mean.abs().topk(k).indices
    out[keep] = mean[keep]
    return out


def topk_average_overwriting(tensor, k):
    # all-gathered right, but an entry kept by two ranks keeps only the last rank's value
    indices = tensor.abs().topk(k).indices
    p = dist.get_world_size()
    all_values = [torch.empty(k) for _ in range(p)]
    all_indices = [torch.empty_like(indices) for _ in range(p)]
    dist.all_gather(all_values, tensor[indices])
    dist.all_gather(all_indices, indices)
    out = torch.zeros_like(tensor)
    for v, i in zip(all_values, all_indices):
        out[i] = v
    return out / p


# --- notebook 08: a batched PowerSGD hook ------------------------------------------------------------


def _batched_hook(state, bucket, error_feedback=True, divide=True, all_reduce_q=True, shape=None, fresh_q=None,
                  orthogonalize_p=True, divide_by=1, own_error=False):
    # solutions/nb08.py's hook, with one thing changed at a time
    import math

    from course_lib import hooks
    from course_lib.lowrank import orthogonalize_

    buffer, key, world_size = bucket.buffer(), bucket.index(), dist.get_world_size()
    n = buffer.numel()
    rows = math.ceil(math.sqrt(n)) if shape is None else shape(n)
    cols = math.ceil(n / rows)
    r = min(state.matrix_approximation_rank, rows, cols)
    error, q = state.memory.get(key, (torch.zeros_like(buffer), None))
    wanted = buffer + error if error_feedback else buffer.clone()
    matrix = torch.zeros(rows * cols)
    matrix[:n] = wanted
    matrix = matrix.view(rows, cols)
    if q is None:
        q = state.fresh_q(cols, r) if fresh_q is None else fresh_q(cols, r)
    p = matrix @ orthogonalize_(q)
    dist.all_reduce(p)
    if orthogonalize_p:
        orthogonalize_(p)
    else:
        p /= p.norm()  # normalized, its columns not made orthogonal
    own = p @ (matrix.T @ p).T  # this rank's own matrix, projected
    q = matrix.T @ p
    if all_reduce_q:
        dist.all_reduce(q)
        if divide:
            q /= world_size * divide_by
    else:
        dist.all_reduce(torch.zeros(1))  # the same collectives, but each rank keeps its own Q
    received = (p @ q.T).flatten()[:n]
    buffer.copy_(received)
    state.memory[key] = ((wanted - own.flatten()[:n]) if own_error else (wanted - received), q)
    return hooks.completed_future(buffer)


def batched_hook_without_error_feedback(state, bucket):
    return _batched_hook(state, bucket, error_feedback=False)


def batched_hook_without_dividing(state, bucket):
    return _batched_hook(state, bucket, divide=False)


def batched_hook_with_its_own_q(state, bucket):
    return _batched_hook(state, bucket, all_reduce_q=False)


def batched_hook_two_columns(state, bucket):
    return _batched_hook(state, bucket, shape=lambda n: (n + 1) // 2)  # an n/2 x 2 matrix: no compression


def batched_hook_with_q_of_its_own_draw(state, bucket):
    g = torch.Generator().manual_seed(dist.get_rank())  # a different first Q on each rank
    return _batched_hook(state, bucket, fresh_q=lambda rows, cols: torch.randn(rows, cols, generator=g))


def batched_hook_layer_by_layer(state, bucket):
    from course_lib import hooks
    # a right answer to notebook 07's exercise, not this one: one P and one Q all-reduce per tensor
    for t in bucket.gradients():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return hooks.completed_future(bucket.buffer())


def batched_hook_dividing_q_twice(state, bucket):
    return _batched_hook(state, bucket, divide_by=2)  # half the approximation, every step


def batched_hook_normalizing_p(state, bucket):
    return _batched_hook(state, bucket, orthogonalize_p=False)


def batched_hook_round_robin(state, bucket):
    """Not low-rank at all: a rotating block of the corrected gradient, within the budget, with error feedback."""
    import math

    from course_lib import hooks

    buffer, key, world_size = bucket.buffer(), bucket.index(), dist.get_world_size()
    n = buffer.numel()
    k = 2 * math.ceil(math.sqrt(n))
    error, t = state.memory.get(key, (torch.zeros_like(buffer), 0))
    wanted = buffer + error
    index = torch.arange(t * 2 * k, (t + 1) * 2 * k) % n
    first, second = wanted[index[:k]].clone(), wanted[index[k:]].clone()
    dist.all_reduce(first)
    dist.all_reduce(second)
    sent = torch.zeros_like(buffer)
    sent[index[:k]], sent[index[k:]] = first / world_size, second / world_size
    own = torch.zeros_like(buffer)
    own[index] = wanted[index]
    state.memory[key] = (wanted - own, t + 1)
    buffer.copy_(sent)
    return hooks.completed_future(buffer)


def batched_hook_with_its_own_error(state, bucket):
    # right: each rank keeps what its own matrix lost (EF-SGD's form); the ranks' mean memory is the same
    return _batched_hook(state, bucket, own_error=True)


def batched_hook_without_warm_start(state, bucket):
    # right: warm start helps, but a fresh Q at every step is still PowerSGD with error feedback
    state.memory = {k: (e, None) for k, (e, _) in state.memory.items()}
    return _batched_hook(state, bucket)


# notebook 04's memory hook, wrong four ways: a memory that does not follow its parameters through DDP's
# bucket rebuild (by bucket index, by position in the bucket), the sum of the rank's own gradients instead
# of the averaged ones, and a key the check cannot find the parameter by


def _allreduce_then(state, bucket, keep):
    buffer = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()

    def then(fut):
        averaged = fut.value()[0]
        keep(averaged)
        return averaged

    return fut.then(then)


def _pieces(bucket, flat):
    offset = 0
    for p in bucket.parameters():
        yield p, flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def memory_hook_keyed_by_bucket_index(state, bucket):
    def keep(averaged):
        old = state.memory.get(bucket.index())
        fresh = old is None or old.shape != averaged.shape
        state.memory[bucket.index()] = averaged.clone() if fresh else old + averaged
        for p, piece in _pieces(bucket, state.memory[bucket.index()]):  # the check reads memory[p]
            state.memory[p] = piece
    return _allreduce_then(state, bucket, keep)


def memory_hook_keyed_by_position(state, bucket):
    def keep(averaged):
        for i, (p, piece) in enumerate(_pieces(bucket, averaged)):
            old = state.memory.get(("position", i))
            total = piece.clone() if old is None or old.shape != piece.shape else old + piece
            state.memory[("position", i)] = total
            state.memory[p] = total
    return _allreduce_then(state, bucket, keep)


def memory_hook_before_averaging(state, bucket):
    for p, piece in _pieces(bucket, bucket.buffer()):
        state.memory[p] = state.memory.get(p, 0) + piece.detach().clone()
    return _allreduce_then(state, bucket, lambda averaged: None)


def memory_hook_keyed_by_name_string(state, bucket):
    def keep(averaged):
        for p, piece in _pieces(bucket, averaged):
            key = f"{tuple(p.shape)}"
            state.memory[key] = state.memory.get(key, 0) + piece.clone()
    return _allreduce_then(state, bucket, keep)


def memory_hook_without_dividing(state, bucket):
    """The sum over the ranks kept and returned: memory and .grad agree with each other, not with the average."""
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer, async_op=True).get_future()

    def then(fut):
        summed = fut.value()[0]
        for p, piece in _pieces(bucket, summed):
            state.memory[p] = state.memory.get(p, 0) + piece.clone()
        return summed

    return fut.then(then)


def memory_hook_without_communicating(state, bucket):
    """This rank's own gradient kept and returned, nothing sent."""
    for p, piece in _pieces(bucket, bucket.buffer()):
        state.memory[p] = state.memory.get(p, 0) + piece.clone()
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
