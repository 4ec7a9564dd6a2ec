"""The course's own functions, handed to its exercise checks as a student might hand them: each of these
answers an exercise by calling the function of ``course_lib`` (or of the check itself) that computes it.
``tests/test_exercise_refusals.py`` asserts that every check refuses them. Top-level functions, so
that the checks that run a student's function in gloo processes can import them by name."""

import torch
import torch.distributed as dist

from course_lib import accumulation, collectives, memory, powersgd
from course_lib.notebooks import exercises as ex
from course_lib.notebooks.exercises import nb00, nb02, nb05


def sum_of_squares(one, vector):
    return nb00.sum_of_squares_expected(one, vector)


def elementwise_max(one, vector):
    return nb00.elementwise_max_expected(one, vector)


def ddp_token_step(model, micro_batches):
    n = torch.tensor(float(sum(len(s) - 1 for batch in micro_batches for s in batch)))
    dist.all_reduce(n)
    accumulation.accumulate_tokens(model, micro_batches, int(n.item()), dist.get_world_size())


def ring_shift(tensor):
    return collectives.ring_shift(tensor)


def recursive_doubling(tensor):
    return nb02.all_reduce_expected(tensor)


def recursive_halving(tensor):
    return collectives.reduce_scatter(tensor)


def recursive_halving_by_ring(tensor):
    return collectives.ring_reduce_scatter(tensor)


def zero2_gradient(grads, group=None):
    return nb05.zero2_gradient_expected(grads, group)


def topk_average(tensor, k):
    return ex.topk_average_expected(tensor, k)


def topk_average_of_whole_tensors(tensor, k):
    """Right numbers, wrong lesson: every rank's whole tensor all-gathered, then each one's top-k kept."""
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    out = torch.zeros_like(tensor)
    for t in everyone:
        keep = t.abs().topk(k).indices
        out[keep] += t[keep]
    return out / len(everyone)


_STATE = {}


def batched_powersgd_hook(state, bucket):
    """The course's batched hook, with a state of its own kind (made at the first call, alike on every rank)."""
    if "course" not in _STATE:
        _STATE["course"] = powersgd.PowerSGDState(matrix_approximation_rank=state.matrix_approximation_rank,
                                                  start_powerSGD_iter=2)
        _STATE["course"].iter = 2
    return powersgd.batched_powerSGD_hook(_STATE["course"], bucket)


_KEYS = {}


def memory_hook_by_parameter_keys(state, bucket):
    """Notebook 04's memory hook, keyed by the course's ``memory.ParameterKeys`` (what PowerSGD's memory uses)."""
    keys = _KEYS.setdefault("keys", memory.ParameterKeys())
    layout = keys.layout(bucket.parameters())
    buffer = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()

    def keep(fut):
        averaged, offset = fut.value()[0], 0
        for p, (_, numel) in zip(bucket.parameters(), layout):
            state.memory[p] = state.memory.get(p, 0) + averaged[offset:offset + numel].view_as(p).clone()
            offset += numel
        return averaged

    return fut.then(keep)


def memory_hook_by_parameter_keys_in_the_callback(state, bucket):
    """The same, with the course's keys called only in the callback, which runs later on gloo's thread."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()

    def keep(fut):
        keys = _KEYS.setdefault("keys", memory.ParameterKeys())
        averaged, offset = fut.value()[0], 0
        for p, (_, numel) in zip(bucket.parameters(), keys.layout(bucket.parameters())):
            state.memory[p] = state.memory.get(p, 0) + averaged[offset:offset + numel].view_as(p).clone()
            offset += numel
        return averaged

    return fut.then(keep)
