"""Pipeline execution: one plan's instructions run on every rank (`executor`, over `p2p`), with
per-stage activation recomputation (`recompute`); plans are made ahead on the planning rank and
fetched by the others (`plan_source`, `plan_distribution`); a dead peer is named, not waited for
(`liveness`); Megatron's own 1F1B schedule runs the baselines (`megatron_baseline`).
"""
