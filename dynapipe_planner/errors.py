"""The one exception type the planner raises for bad input, so CLIs can print it cleanly."""


class PlanningError(ValueError):
    """Input the planner cannot honour; the message names the offending item."""
