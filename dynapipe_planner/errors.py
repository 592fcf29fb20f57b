"""The planner's exceptions: one base type for bad input, so CLIs can print any of them cleanly,
and subclasses for the plan checks of the simulator, so tests and callers can tell them apart;
apart from those, the failures of the planning service, which are not the input's fault; and
how every message names an iteration."""


class PlanningError(ValueError):
    """Input the planner cannot honour; the message names the offending item."""


class CostModelError(PlanningError):
    """A cost model priced a micro-batch at a time no run can take (negative or NaN): a fault
    of the model, never a reason to skip the candidate that holds it."""


class PlanCheckError(PlanningError):
    """A plan breaks an invariant of the ExecutionPlan contract (missing or repeated passes,
    data used before it is received, unwaited communication, memory above the limit)."""


class CommMismatchError(PlanningError):
    """Two neighbouring ranks post their point-to-point operations in different orders, kinds or
    shapes; NCCL pairs them by position, so the run would hang or corrupt tensors."""


class DeadlockError(PlanningError):
    """No rank can make progress although some still have instructions left."""


class PlanningServiceError(RuntimeError):
    """The planning service cannot deliver a plan: a worker died or crashed, the work source has
    no such iteration, or the service is closed. The message names the iteration."""


class PlanTimeoutError(PlanningServiceError, TimeoutError):
    """A plan did not arrive in time (from the planner workers or from the planning rank)."""


def iteration_name(index: int) -> str:
    """How a message names the iteration of 0-based `index` (the sampler's, the planning
    service's and the plan store's key): counted from 1, as the progress lines count them
    (`iteration 1/10` is index 0), so an error names the iteration the user sees in the log."""
    return f"iteration {index + 1}"
