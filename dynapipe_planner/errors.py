"""The planner's exceptions: one base type for bad input, so CLIs can print any of them cleanly,
and subclasses for the plan checks of the simulator, so tests and callers can tell them apart."""


class PlanningError(ValueError):
    """Input the planner cannot honour; the message names the offending item."""


class PlanCheckError(PlanningError):
    """A plan breaks an invariant of the ExecutionPlan contract (missing or repeated passes,
    data used before it is received, unwaited communication, memory above the limit)."""


class CommMismatchError(PlanningError):
    """Two neighbouring ranks post their point-to-point operations in different orders, kinds or
    shapes; NCCL pairs them by position, so the run would hang or corrupt tensors."""


class DeadlockError(PlanningError):
    """No rank can make progress although some still have instructions left."""
