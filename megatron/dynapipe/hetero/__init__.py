"""Heterogeneous strategies: several parallel layouts side by side (`groups`, `grad_sync`, the
`--hetero-plan` file checked against the job's ranks in `plan_file`), the stage models of the
strategies a job may switch between (`strategy_models`; the planner's
`dynapipe_planner.strategy.candidates` picks the strategies), the disaggregated optimiser that
makes a switch free (`switch`), its layout-independent checkpoints (`checkpointing`) and the
training loop over them (`training`).
"""
