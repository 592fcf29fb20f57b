"""Heterogeneous strategies: several parallel layouts side by side (`groups`, `grad_sync`, the
`--hetero-plan` file in `plan_file`), the strategies a job may switch between (`candidates`,
`strategy_models`), the disaggregated optimiser that makes a switch free (`switch`), its
layout-independent checkpoints (`checkpointing`) and the training loop over them (`training`).
"""
