"""HexiScale (seed hexiscale.txt): plans for clusters of mixed GPUs and links, where every
pipeline has its own devices, depth, per-stage TP degree, layer ranges and batch size.

`cost` prices plans (App. A), `simulate` replays them under 1F1B, `graph_partition` splits the
device graph (§4.2), `stage_order` and `layer_assign` build each pipeline (§4.3), `search`
iterates (§4.4), `milp` is the exact reference for tiny clusters (App. D), `baselines` the
systems of §5 in the same cost model, `plan_file` and `cli` the output (`plan_file` also reads
the static layouts of the runtime's `--hetero-plan`). The cluster itself is
`dynapipe_planner.devices`.
"""
