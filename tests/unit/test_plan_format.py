"""ExecutionPlan files: JSON and binary carry the same plan; malformed files are rejected with
the offending item named, and a failed write leaves nothing behind."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import MAGIC, ExecutionPlan, atomic_write, load_plan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig


@pytest.fixture(scope="module")
def plans() -> dict[str, ExecutionPlan]:
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=3, num_replicas=2)
    model = AnalyticCostModel(MODEL_PRESETS["gpt-350m"], cluster)
    lengths = np.random.default_rng(0).integers(8, 1500, 120)
    out = {}
    for batching in ("dynamic", "packing"):
        config = PlannerConfig(num_replicas=2, batching=batching)
        out[batching] = IterationPlanner(model, 3, config).plan(lengths)
    return out


@pytest.mark.parametrize("batching", ["dynamic", "packing"])
@pytest.mark.parametrize("fmt", ["json", "bin"])
def test_round_trip(tmp_path, plans, batching, fmt):
    plan = plans[batching]
    path = tmp_path / f"plan.{fmt}"
    plan.save(path, fmt)
    assert load_plan(path).to_dict() == json.loads(json.dumps(plan.to_dict()))
    assert (path.read_bytes()[: len(MAGIC)] == MAGIC) == (fmt == "bin")


def test_binary_is_compact(tmp_path, plans):
    plans["dynamic"].save(tmp_path / "p.json")
    plans["dynamic"].save(tmp_path / "p.bin")
    assert (tmp_path / "p.bin").stat().st_size < (tmp_path / "p.json").stat().st_size / 2


def test_packed_rows_survive(plans):
    packed = [m for m in plans["packing"].microbatches if m.row_sizes]
    assert packed and all(sum(m.row_sizes) == len(m.samples) for m in packed)
    assert all(m.attention_saved > 0 for m in packed)  # block-diagonal attention travels along
    again = ExecutionPlan.from_bytes(plans["packing"].to_bytes())
    assert [m.row_sizes for m in again.microbatches] == [m.row_sizes for m in packed]
    saved = [m.attention_saved for m in packed]
    assert [m.attention_saved for m in again.microbatches] == saved
    # DynaPipe's micro-batches are padded (nothing saved) or packed rows of their own length
    assert all(m.row_sizes or not m.attention_saved for m in plans["dynamic"].microbatches)


def mutate(plan: ExecutionPlan, edit) -> dict:
    data = json.loads(json.dumps(plan.to_dict()))
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("ranks"), "plan is missing 'ranks'"),
        (lambda d: d.update(version=7), "plan version 7"),
        (
            lambda d: d["ranks"][1]["instructions"][2].update(op="Teleport"),
            r"instruction 2 \(Teleport",
        ),
        (
            lambda d: d["ranks"][0]["instructions"][0].pop("mb"),
            r"ranks\[0\].instructions\[0\] is missing 'mb'",
        ),
        (lambda d: d["microbatches"][3].update(samples=["a"]), r"microbatches\[3\].samples"),
        (lambda d: d["microbatches"].append(dict(d["microbatches"][0])), "appears twice"),
        (lambda d: d["ranks"].pop(), "ranks, expected 6"),
        (lambda d: d["microbatches"][0].update(row_sizes=[99]), "row_sizes do not cover"),
        (
            lambda d: d["microbatches"][2].update(attention_saved=-1.0),
            r"microbatches\[2\].attention_saved must be a number >= 0",
        ),
    ],
)
def test_malformed_json_names_the_item(plans, edit, message):
    with pytest.raises(PlanningError, match=message):
        ExecutionPlan.from_dict(mutate(plans["dynamic"], edit))


def test_comm_instruction_with_wrong_peer_is_rejected(plans):
    def edit(d):
        for ins in d["ranks"][0]["instructions"]:
            if ins["op"] == "SendActStart":
                ins["peer"] = 2
                return

    with pytest.raises(PlanningError, match="peer 2, expected stage 1"):
        ExecutionPlan.from_dict(mutate(plans["dynamic"], edit))


def test_truncated_and_corrupt_binary(tmp_path, plans):
    buf = plans["dynamic"].to_bytes()
    (tmp_path / "cut.bin").write_bytes(buf[: len(buf) // 2])
    with pytest.raises(PlanningError, match=r"cut.bin: truncated at byte \d+ while reading"):
        load_plan(tmp_path / "cut.bin")
    (tmp_path / "tail.bin").write_bytes(buf + b"\0\0")
    with pytest.raises(PlanningError, match="2 trailing bytes"):
        load_plan(tmp_path / "tail.bin")
    (tmp_path / "junk.json").write_bytes(b"{not json")
    with pytest.raises(PlanningError, match=r"junk\.json: neither a binary plan nor valid JSON"):
        load_plan(tmp_path / "junk.json")
    with pytest.raises(PlanningError, match="cannot read plan"):
        load_plan(tmp_path / "missing.json")


def test_failed_write_leaves_nothing(tmp_path, plans, monkeypatch):
    target = tmp_path / "plan.json"

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        plans["dynamic"].save(target)
    assert os.listdir(tmp_path) == []


def test_a_target_that_is_not_a_regular_file_is_refused_and_kept(tmp_path, plans):
    """Renaming over it would replace a directory, FIFO or device (issue 34)."""
    target = tmp_path / "plan.json"
    target.mkdir()
    with pytest.raises(PlanningError, match=r"plan\.json is not a regular file"):
        plans["dynamic"].save(target)
    assert sorted(os.listdir(tmp_path)) == ["plan.json"] and os.listdir(target) == []


def test_atomic_write_leaves_only_the_file_with_normal_permissions(tmp_path):
    target = tmp_path / "t.json"
    atomic_write(target, b'{"a": 1}')
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
