"""Every exercise of the course, checked against the course's reference, with a clear verdict: one
module per notebook (``nb00`` to ``nb12``, as ``solutions/``), sharing ``core``.

One pattern in every notebook: write ``my_thing``, then run ``exercises.check_thing(my_thing)``.
Each ``check_*`` below holds the exercise's inputs and its reference answer (the course's own
function) and calls :func:`check`, which runs both on the same inputs (each on its own copy, since
many functions here work in place), compares the results, and prints either a pass or the first
case that differs: which input, expected, got. Functions that communicate go through
:func:`check_distributed`, which runs them in real gloo processes, and can hold them to what the
exercise allows (only send and recv, one collective, log2 p messages: see :class:`Rules`).
"""

from course_lib.notebooks.exercises.core import NotAllowed, Rules, check, check_distributed, compare
from course_lib.notebooks.exercises.nb00 import (
    check_elementwise_max,
    check_sum_of_squares,
    elementwise_max_expected,
    rank_inputs,
    sum_of_squares_expected,
)
from course_lib.notebooks.exercises.nb01 import check_ddp_token_step
from course_lib.notebooks.exercises.nb02 import (
    POINT_TO_POINT_ONLY,
    all_but_own_chunk,
    all_reduce_expected,
    check_recursive_doubling,
    check_recursive_halving,
    check_ring_shift,
    exercise_inputs,
    halving_inputs,
    ring_shift_expected,
)
from course_lib.notebooks.exercises.nb03 import check_exposed_time, exposed_time
from course_lib.notebooks.exercises.nb04 import (
    MemoryHookState,
    check_ddp_all_reduces,
    check_memory_hook,
    ddp_all_reduces,
)
from course_lib.notebooks.exercises.nb05 import (
    ZERO2_RULES,
    ZERO2_SHAPES,
    all_but_own_padded_chunk,
    check_bytes_per_rank,
    check_zero2_gradient,
    check_zero3_bytes_sent,
    zero2_gradient_expected,
    zero2_inputs,
    zero_bytes_sent,
)
from course_lib.notebooks.exercises.nb06 import (
    check_pq_singular_values,
    check_rank1_error,
    check_smallest_rank,
    check_stable_orthogonalize,
)
from course_lib.notebooks.exercises.nb07 import (
    check_alternating_powersgd,
    check_mean_and_own_buffer,
    check_memory_per_rank,
    check_numbers_per_step,
)
from course_lib.notebooks.exercises.nb08 import BatchedHookState, check_batched_hook
from course_lib.notebooks.exercises.nb09 import (
    check_dgc_step,
    check_stochastic_rounding,
    check_topk_average,
    topk_average_expected,
    topk_inputs,
)
from course_lib.notebooks.exercises.nb11 import (
    BREAK_EVEN_PERIOD_CASES,
    OUTER_STEP_CASES,
    check_break_even_period,
    check_outer_step,
    outer_step_rounds,
)
from course_lib.notebooks.exercises.nb12 import check_break_even_bandwidth, check_ring_fit

__all__ = [
    "NotAllowed",
    "Rules",
    "check",
    "check_distributed",
    "compare",
    "check_elementwise_max",
    "check_sum_of_squares",
    "elementwise_max_expected",
    "rank_inputs",
    "sum_of_squares_expected",
    "check_ddp_token_step",
    "POINT_TO_POINT_ONLY",
    "all_but_own_chunk",
    "all_reduce_expected",
    "check_recursive_doubling",
    "check_recursive_halving",
    "check_ring_shift",
    "exercise_inputs",
    "halving_inputs",
    "ring_shift_expected",
    "check_ddp_all_reduces",
    "check_memory_hook",
    "MemoryHookState",
    "check_exposed_time",
    "ddp_all_reduces",
    "exposed_time",
    "ZERO2_RULES",
    "ZERO2_SHAPES",
    "all_but_own_padded_chunk",
    "check_bytes_per_rank",
    "check_zero2_gradient",
    "check_zero3_bytes_sent",
    "zero2_gradient_expected",
    "zero2_inputs",
    "zero_bytes_sent",
    "check_pq_singular_values",
    "check_rank1_error",
    "check_smallest_rank",
    "check_stable_orthogonalize",
    "check_mean_and_own_buffer",
    "check_alternating_powersgd",
    "check_memory_per_rank",
    "check_numbers_per_step",
    "BatchedHookState",
    "check_batched_hook",
    "check_dgc_step",
    "check_stochastic_rounding",
    "check_topk_average",
    "topk_average_expected",
    "topk_inputs",
    "BREAK_EVEN_PERIOD_CASES",
    "OUTER_STEP_CASES",
    "check_break_even_period",
    "check_outer_step",
    "outer_step_rounds",
    "check_break_even_bandwidth",
    "check_ring_fit",
]
