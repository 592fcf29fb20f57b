"""Pipeline schedules: 1F1B and DynaPipe's memory-aware adaptive schedule (seed dynapipe.txt §5).

A schedule is, per stage, a list of op codes (2*m forward, 2*m+1 backward of micro-batch m).
The public functions run on the C++ core; their readable pure-Python twins, which the tests
hold the core to, are in `dynapipe_planner._reference.schedules`.
"""

from .adaptive import adaptive_schedule
from .bound import makespan_lower_bound, memory_time_lower_bound
from .memory import peak_activation
from .one_f_one_b import one_f_one_b
from .ordering import cluster_permutations
from .search import ScheduleChoice, search_schedule
from .timeline import Timeline, timeline

__all__ = [
    "ScheduleChoice",
    "Timeline",
    "adaptive_schedule",
    "cluster_permutations",
    "makespan_lower_bound",
    "memory_time_lower_bound",
    "one_f_one_b",
    "peak_activation",
    "search_schedule",
    "timeline",
]
