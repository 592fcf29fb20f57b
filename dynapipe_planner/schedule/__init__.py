"""Pipeline schedules: 1F1B and DynaPipe's memory-aware adaptive schedule (seed dynapipe.txt §5).

A schedule is, per stage, a list of op codes (2*m forward, 2*m+1 backward of micro-batch m).
The public functions run on the C++ core; the `*_reference` functions are the readable
pure-Python versions the tests hold the core to.
"""

from .adaptive import adaptive_schedule, adaptive_schedule_reference
from .bound import makespan_lower_bound, memory_time_lower_bound
from .memory import peak_activation, peak_activation_reference
from .one_f_one_b import one_f_one_b, one_f_one_b_reference
from .ordering import cluster_permutations
from .search import ScheduleChoice, search_schedule
from .timeline import Timeline, timeline, timeline_reference

__all__ = [
    "ScheduleChoice",
    "Timeline",
    "adaptive_schedule",
    "adaptive_schedule_reference",
    "cluster_permutations",
    "makespan_lower_bound",
    "memory_time_lower_bound",
    "one_f_one_b",
    "one_f_one_b_reference",
    "peak_activation",
    "peak_activation_reference",
    "search_schedule",
    "timeline",
    "timeline_reference",
]
