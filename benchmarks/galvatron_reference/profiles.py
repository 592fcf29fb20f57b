"""Write our search's cost inputs as hetu-galvatron 2.4.0 profile JSON files.

Galvatron's search engine reads five files from disk (names and keys below are its format; the
numbers are ours). Units follow what its cost model multiplies them with:

* `computation_profiling_<precision>_<model>.json` ("static" mode): `layertype_0_bsz<b>_seq<s>`
  is the forward time of one layer for one sample in ms; Galvatron divides it by the TP degree
  itself. `layertype_other_bsz<b>_seq<s>` is the embedding/output forward time per sample.
* `memory_profiling_<precision>_<model>.json`: `layertype_0[<seq>]` holds `parameter_size` (MiB;
  Galvatron takes model states as 4x this, split by TP and, for SDP, by the group) and
  `tp_activation_per_bsz_dict` (MiB of stored activations per sample per TP degree, plus
  `checkpoint`: what a recomputed layer keeps). `other_memory_pp_off`, `other_memory_pp_on_first`
  and `other_memory_pp_on_last` (`[<seq>]["model_states"|"activation"][<vocab tp>]`, MiB) are the
  embedding and output layers' memory, one entry per vocabulary TP degree 1, 2, 4, ... (split
  that many ways): Galvatron's default search (`disable_vtp=0`) tries every degree and skips
  those without an entry.
* `allreduce_bandwidth_<n>nodes_<g>gpus_per_node.json`: `allreduce_size_<k>_consec_<0|1>`, the
  ring all-reduce bus bandwidth of groups of k GPUs, consecutive (`1`) or strided by N/k (`0`,
  how its hardware profiler forms them), as MiB per ms: Galvatron's coefficient is 1/value in ms
  per MB with message sizes in MiB, so writing MiB/ms makes it price exactly the seconds our
  bytes/s do (nccl-tests' GB/s would be 4.9% off).
* `p2p_bandwidth_<n>nodes_<g>gpus_per_node.json`: `pp_size_<p>` (MiB per ms) between stages.
* `overlap_coefficient.json`: `overlap_coe`, the compute/communication overlap slowdown.
* `sp_time_<n>nodes_<g>gpus_per_node.json`: all-reduce and all-to-all times (ms) per TP group
  size and message size; read at start-up even when sequence parallelism is off, so it is
  written from the same bandwidths.

`galvatron_representable` projects cost inputs onto what these files can express, so that the
two engines can be fed identical data; everything it drops is listed in its docstring.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynapipe_planner.search.cost_inputs import CostInputs

MIB = 2**20
# Galvatron's model states are 4x `parameter_size`: 16 bytes per parameter of fp32 size, i.e.
# 8 bytes per bf16 weight byte (bf16 weights + gradients, fp32 master copy and Adam moments).
GALVATRON_STATE_FACTOR = 8.0
# Message sizes written to the sequence-parallel timing file (Galvatron fits a line, >= 8 points).
SP_MESSAGE_MIB = tuple(2**i for i in range(11))


def bandwidth_mib_per_ms(bytes_per_s: float) -> float:
    """Bytes/s as Galvatron's bandwidth unit (MiB per ms)."""
    return bytes_per_s / MIB / 1e3


def power_of_two_degrees(num_gpus: int) -> list[int]:
    """2, 4, ..., num_gpus: the group sizes Galvatron's profiles and search space use."""
    out, k = [], 2
    while k <= num_gpus:
        out.append(k)
        k *= 2
    return out


def galvatron_representable(inputs: CostInputs, num_gpus: int) -> CostInputs:
    """`inputs` reduced to what Galvatron's profile files express, so both engines see the same
    numbers. What changes, and why:

    * forward time at TP degree k becomes (TP-1 time) / k: Galvatron stores one per-sample time
      and divides by k itself;
    * the backward pass's transient workspace becomes 0: Galvatron has no such term;
    * model states become 8 bytes per bf16 weight byte (Galvatron's fixed 4x fp32 parameters),
      which also makes its DP gradient message equal to our bf16 all-reduce;
    * link latency becomes 0: Galvatron prices communication by bandwidth only;
    * embedding and output layers are dropped: Galvatron prices them with its own vocabulary-
      parallel rules (and SDP of the embedding) that ours does not share;
    * a strided group's bandwidth becomes that of the group strided by N/k that Galvatron's
      hardware profile measures (one `consec_0` number per size), even where our topology
      would keep a narrower stride inside a node.

    Only one layer type is supported: Galvatron partitions a single-type model evenly, and the
    GPT/LLaMA-class models of the benchmark have one.
    """
    if len(inputs.layer_types) != 1:
        raise ValueError("Galvatron's static profiles are written for one layer type")
    lt = inputs.layer_types[0]
    fwd1 = lt.forward_s_per_sample[1]
    tps = sorted(lt.forward_s_per_sample)
    new_type = dataclasses.replace(
        lt,
        forward_s_per_sample={k: fwd1 / k for k in tps},
        workspace_bytes_per_sample={k: 0.0 for k in tps},
    )
    allreduce = {}
    for (size, stride), bw in inputs.allreduce_bandwidth.items():
        if stride > 1 and (size, num_gpus // size) in inputs.allreduce_bandwidth:
            bw = inputs.allreduce_bandwidth[(size, num_gpus // size)]
        allreduce[(size, stride)] = bw
    return dataclasses.replace(
        inputs,
        layer_types=(new_type,),
        allreduce_bandwidth=allreduce,
        model_state_factor=GALVATRON_STATE_FACTOR,
        link_latency_s=0.0,
        embedding_param_bytes=0.0,
        output_param_bytes=0.0,
        output_forward_s_per_sample=0.0,
        output_activation_bytes_per_sample=0.0,
    )


def _group_bandwidth(inputs: CostInputs, size: int, consecutive: bool, num_gpus: int) -> float:
    stride = 1 if consecutive else num_gpus // size
    return inputs.bandwidth(size, stride)


def profile_documents(
    inputs: CostInputs,
    *,
    model_name: str,
    num_gpus: int,
    gpus_per_node: int,
    hidden_size: int,
    mixed_precision: str = "bf16",
) -> dict[str, dict[str, Any]]:
    """File name -> JSON document of every profile Galvatron's search reads."""
    if len(inputs.layer_types) != 1:
        raise ValueError("Galvatron's static profiles are written for one layer type")
    if num_gpus % gpus_per_node and gpus_per_node % num_gpus:
        raise ValueError(f"{num_gpus} GPUs do not fill nodes of {gpus_per_node}")
    lt = inputs.layer_types[0]
    seq = int(inputs.seq_length)
    num_nodes = max(1, num_gpus // gpus_per_node)
    per_node = min(gpus_per_node, num_gpus)
    hw = f"{num_nodes}nodes_{per_node}gpus_per_node"
    # Galvatron reads one number per key in static mode; the batch size in the key is a label.
    computation = {
        f"layertype_0_bsz1_seq{seq}": lt.forward_s_per_sample[1] * 1e3,
        f"layertype_other_bsz1_seq{seq}": inputs.output_forward_s_per_sample * 1e3,
    }
    activation: dict[str, float] = {
        str(k): v / MIB for k, v in sorted(lt.activation_bytes_per_sample.items())
    }
    activation["checkpoint"] = lt.boundary_bytes_per_sample / MIB
    states = inputs.model_state_factor
    # The embedding and output layers split by vocabulary TP degree v (1, 2, 4, ...): Galvatron
    # searches every v (its default `disable_vtp=0`) and reads one entry per v.
    vocab_tps = [1, *power_of_two_degrees(num_gpus)]

    def split(total_bytes: float) -> dict[str, float]:
        return {str(v): total_bytes / MIB / v for v in vocab_tps}

    output_act = inputs.output_activation_bytes_per_sample
    memory = {
        "layertype_0": {
            str(seq): {
                "parameter_size": lt.param_bytes * states / 4.0 / MIB,
                "tp_activation_per_bsz_dict": activation,
            }
        },
        "other_memory_pp_off": {
            str(seq): {
                "model_states": split(
                    (inputs.embedding_param_bytes + inputs.output_param_bytes) * states
                ),
                "activation": split(output_act),
            }
        },
        "other_memory_pp_on_first": {
            str(seq): {
                "model_states": split(inputs.embedding_param_bytes * states),
                "activation": split(0.0),
            }
        },
        "other_memory_pp_on_last": {
            str(seq): {
                "model_states": split(inputs.output_param_bytes * states),
                "activation": split(output_act),
            }
        },
    }
    allreduce: dict[str, float] = {}
    for size in sorted(power_of_two_degrees(num_gpus), reverse=True):
        for consecutive in (1, 0):
            if size == num_gpus and not consecutive:
                continue  # the whole job has one layout
            bw = _group_bandwidth(inputs, size, bool(consecutive), num_gpus)
            allreduce[f"allreduce_size_{size}_consec_{consecutive}"] = bandwidth_mib_per_ms(bw)
    p2p = {
        f"pp_size_{pp}": bandwidth_mib_per_ms(inputs.p2p_bandwidth[pp])
        for pp in power_of_two_degrees(num_gpus)
        if pp in inputs.p2p_bandwidth
    }
    sp_time: dict[str, float] = {}
    for size in power_of_two_degrees(num_gpus):
        bw = bandwidth_mib_per_ms(_group_bandwidth(inputs, size, True, num_gpus))
        for mib in SP_MESSAGE_MIB:
            ring = (size - 1) / size * mib / bw
            sp_time[f"allreduce_size_{size}_{mib}MB_time"] = 2.0 * ring
            sp_time[f"all2all_size_{size}_{mib}MB_time"] = ring
    return {
        f"computation_profiling_{mixed_precision}_{model_name}.json": computation,
        f"memory_profiling_{mixed_precision}_{model_name}.json": memory,
        f"allreduce_bandwidth_{hw}.json": allreduce,
        f"p2p_bandwidth_{hw}.json": p2p,
        "overlap_coefficient.json": {"overlap_coe": inputs.overlap_slowdown},
        f"sp_time_{hw}.json": sp_time,
    }


def write_profiles(directory: str, documents: dict[str, dict[str, Any]]) -> list[str]:
    """Write `profile_documents` output into `directory`; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, doc in documents.items():
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        paths.append(path)
    return paths
