"""Jobs that run more than one parallel layout, for the two papers that need them.

Hydraulis (`--dynamic-strategies`): the stage models of the strategies a job switches between
(`strategy_models`; the planner's `dynapipe_planner.strategy.candidates` proposes them) and the
disaggregated optimiser that makes a switch free (`switch`). HexiScale (`--hetero-plan`): the
plan file checked against the job's ranks (`plan_file`) and the gradient sync of layers held
with different TP degrees (`grad_sync`). Both: layout-independent checkpoints
(`checkpointing`, `megatron_export`) and the training loop (`training`). The process groups of
every layout are one layer down, in `megatron.dynapipe.layout_groups`.
"""
