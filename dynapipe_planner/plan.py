"""`ExecutionPlan`: one iteration's micro-batches and every rank's instruction list.

The JSON shape is the contract in docs/architecture.md; the runtime reads it and knows nothing of
how it was made. A compact binary form (`.bin`) carries the same content for large plans:

    b"DYNAPLAN" | u32 version | u32 header length | header JSON (num_stages, num_replicas,
    stats, meta, counts, "replicas" for heterogeneous plans, "attention_saved" by micro-batch
    id for packed rows) | micro-batches: i32 id,
    replica, seqlen, tgt_seqlen, u32 n, u32[n] samples, u32 r, u32[r] row sizes | ranks: i32
    replica, stage, u32 n, then per instruction u8 op, u8 dtype, u8 ndim, u8 0, i32 mb,
    i32 peer, i32[ndim] shape (all little-endian)

Instructions follow DynaPipe's executor design (seed `dynapipe.txt` §3): compute ops, and each
communication split into a non-blocking Start and a blocking Wait.

A heterogeneous plan runs pipelines of different depth or tensor-parallel degree side by side
(Hydraulis, seed `hydraulis.txt` §5.1; HexiScale's asymmetric pipelines, `hexiscale.txt` §3).
It lists one `ReplicaLayout` per pipeline in `replicas`: that replica's own `num_stages` decides
its first and last stage, and the top-level `num_stages` is the deepest replica's. A plan with
no layouts is homogeneous, and its JSON and binary forms are exactly those of version 1 before
layouts existed; the layouts travel in the JSON object and in the binary header, so readers of
homogeneous plans need no new version.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from .errors import PlanningError
from .input_files import parse_json_document, read_input_file

PLAN_VERSION = 1
MAGIC = b"DYNAPLAN"

OPS = (
    "LoadBatch",
    "ForwardPass",
    "BackwardPass",
    "SendActStart",
    "RecvActStart",
    "SendGradStart",
    "RecvGradStart",
    "WaitSendAct",
    "WaitRecvAct",
    "WaitSendGrad",
    "WaitRecvGrad",
    "FreeBuffer",
)
START_OPS = ("SendActStart", "RecvActStart", "SendGradStart", "RecvGradStart")
WAIT_OPS = ("WaitSendAct", "WaitRecvAct", "WaitSendGrad", "WaitRecvGrad")
WAIT_FOR_START = dict(zip(START_OPS, WAIT_OPS, strict=True))
COMM_OPS = START_OPS + WAIT_OPS
DTYPES = ("bf16", "fp16", "fp32")
_OP_CODE = {op: i for i, op in enumerate(OPS)}
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}

# A sequence length past this is no plan's (and overflows the cost tables' int64 grids).
MAX_SEQLEN = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a rank's program.

    `peer` is a stage index in the same replica (-1: none). Start instructions carry the
    tensor's `shape` and `dtype`, so nothing is exchanged at run time.
    """

    op: str
    mb: int
    peer: int = -1
    shape: tuple[int, ...] = ()
    dtype: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "mb": self.mb}
        if self.peer >= 0:
            d["peer"] = self.peer
        if self.shape:
            d["shape"] = list(self.shape)
        if self.dtype:
            d["dtype"] = self.dtype
        return d


@dataclass
class MicroBatch:
    """Samples of one micro-batch, padded to `seqlen` (and `tgt_seqlen` for encoder-decoder).

    `row_sizes` is set for packed micro-batches: the samples fill tensor rows in order, row k
    taking the next row_sizes[k] samples. Empty means one sample per row.
    """

    id: int
    replica: int
    samples: list[int]
    seqlen: int
    tgt_seqlen: int = 0
    row_sizes: list[int] = field(default_factory=list)
    # Packed rows: tokens^2 of self-attention their block-diagonal mask skips (sum over rows),
    # so the simulator prices them as the planner did (variable-length attention).
    attention_saved: float = 0.0

    @property
    def num_rows(self) -> int:
        """Rows of the micro-batch tensor (the `b` of its shape)."""
        return len(self.row_sizes) if self.row_sizes else len(self.samples)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "id": self.id,
            "replica": self.replica,
            "samples": list(self.samples),
            "seqlen": self.seqlen,
            "tgt_seqlen": self.tgt_seqlen,
        }
        if self.row_sizes:
            d["row_sizes"] = list(self.row_sizes)
        if self.attention_saved:
            d["attention_saved"] = self.attention_saved
        return d


@dataclass
class RankPlan:
    replica: int
    stage: int
    instructions: list[Instruction]


@dataclass
class StageLayout:
    """Where one pipeline stage runs: its tensor-parallel group (`tp` global device indices) and
    the transformer layers [start, end) it holds. The runtime builds process groups from it."""

    devices: list[int]
    tp: int
    layers: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "tp": self.tp, "layers": list(self.layers)}


@dataclass
class ReplicaLayout:
    """One pipeline of a heterogeneous plan: its depth and the layout of each of its stages."""

    id: int
    num_stages: int
    stages: list[StageLayout]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "num_stages": self.num_stages,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass
class ExecutionPlan:
    """`replicas` empty: every replica has `num_stages` stages (homogeneous). Otherwise one
    layout per replica, and `num_stages` is the deepest replica's."""

    num_stages: int
    num_replicas: int
    microbatches: list[MicroBatch]
    ranks: list[RankPlan]
    stats: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    replicas: list[ReplicaLayout] = field(default_factory=list)

    def replica_num_stages(self, replica: int) -> int:
        """Depth of `replica`'s pipeline: what decides its first and last stage."""
        return self.replicas[replica].num_stages if self.replicas else self.num_stages

    def rank_plan(self, replica: int, stage: int) -> RankPlan:
        for r in self.ranks:
            if r.replica == replica and r.stage == stage:
                return r
        raise PlanningError(f"plan has no rank for replica {replica} stage {stage}")

    # ---- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        # Keys in this order, and "replicas" only when present: homogeneous plans serialise
        # byte for byte as they did before layouts existed.
        layouts = {"replicas": [r.to_dict() for r in self.replicas]} if self.replicas else {}
        return {
            "version": self.version,
            "num_stages": self.num_stages,
            "num_replicas": self.num_replicas,
            **layouts,
            "microbatches": [m.to_dict() for m in self.microbatches],
            "ranks": [
                {
                    "replica": r.replica,
                    "stage": r.stage,
                    "instructions": [i.to_dict() for i in r.instructions],
                }
                for r in self.ranks
            ],
            "stats": self.stats,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> ExecutionPlan:
        need = partial(_need, source)
        version = need(data, "version", "plan")
        if version != PLAN_VERSION:
            raise PlanningError(
                f"{source}: plan version {version}, this reader knows {PLAN_VERSION}"
            )
        mbs = []
        for k, m in enumerate(need(data, "microbatches", "plan", list)):
            where = f"microbatches[{k}]"
            samples = _integers(source, need(m, "samples", where, list), f"{where}.samples")
            rows = _integers(source, m.get("row_sizes", []), f"{where}.row_sizes")
            mbs.append(
                MicroBatch(
                    need(m, "id", where),
                    need(m, "replica", where),
                    samples,
                    need(m, "seqlen", where),
                    _optional(source, m, "tgt_seqlen", where, 0),
                    rows,
                    _attention_saved(source, m.get("attention_saved", 0.0), where),
                )
            )
        ranks = []
        for k, r in enumerate(need(data, "ranks", "plan", list)):
            where = f"ranks[{k}]"
            instrs = []
            for n, ins in enumerate(need(r, "instructions", where, list)):
                iw = f"{where}.instructions[{n}]"
                op = need(ins, "op", iw, str)
                shape = ins.get("shape", [])
                if not isinstance(shape, list) or not all(isinstance(x, int) for x in shape):
                    raise PlanningError(f"{source}: {iw}.shape must be a list of integers")
                instrs.append(
                    Instruction(
                        op,
                        need(ins, "mb", iw),
                        _optional(source, ins, "peer", iw, -1),
                        tuple(shape),
                        _optional(source, ins, "dtype", iw, "", str),
                    )
                )
            ranks.append(RankPlan(need(r, "replica", where), need(r, "stage", where), instrs))
        plan = cls(
            need(data, "num_stages", "plan"),
            need(data, "num_replicas", "plan"),
            mbs,
            ranks,
            data.get("stats", {}),
            data.get("meta", {}),
            version,
            _layouts(source, need(data, "replicas", "plan", list) if "replicas" in data else []),
        )
        validate_structure(plan, source)
        return plan

    # ---- binary -----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        header = {
            "num_stages": self.num_stages,
            "num_replicas": self.num_replicas,
            "num_microbatches": len(self.microbatches),
            "num_ranks": len(self.ranks),
            "stats": self.stats,
            "meta": self.meta,
        }
        if self.replicas:
            header["replicas"] = [r.to_dict() for r in self.replicas]
        saved = {str(m.id): m.attention_saved for m in self.microbatches if m.attention_saved}
        if saved:
            header["attention_saved"] = saved
        hdr = json.dumps(header, separators=(",", ":")).encode()
        out = [MAGIC, struct.pack("<II", self.version, len(hdr)), hdr]
        for m in self.microbatches:
            out.append(
                struct.pack("<iiiiI", m.id, m.replica, m.seqlen, m.tgt_seqlen, len(m.samples))
            )
            out.append(struct.pack(f"<{len(m.samples)}I", *m.samples))
            out.append(struct.pack(f"<I{len(m.row_sizes)}I", len(m.row_sizes), *m.row_sizes))
        for r in self.ranks:
            out.append(struct.pack("<iiI", r.replica, r.stage, len(r.instructions)))
            for ins in r.instructions:
                dt = _DTYPE_CODE.get(ins.dtype, 0)
                out.append(
                    struct.pack("<BBBxii", _OP_CODE[ins.op], dt, len(ins.shape), ins.mb, ins.peer)
                )
                out.append(struct.pack(f"<{len(ins.shape)}i", *ins.shape))
        return b"".join(out)

    @classmethod
    def from_bytes(cls, buf: bytes, source: str = "plan") -> ExecutionPlan:
        reader = _Reader(buf, source)
        if reader.take(len(MAGIC), "magic") != MAGIC:
            raise PlanningError(f"{source}: not a DynaPipe binary plan (bad magic bytes)")
        version, hdr_len = reader.unpack("<II", "version header")
        if version != PLAN_VERSION:
            raise PlanningError(
                f"{source}: plan version {version}, this reader knows {PLAN_VERSION}"
            )
        header = parse_json_document(
            reader.take(hdr_len, "header"), source, kind=dict, invalid="corrupt header"
        )
        mbs = []
        for k in range(header["num_microbatches"]):
            mid, rep, seq, tgt, n = reader.unpack("<iiiiI", f"microbatch {k}")
            samples = list(reader.unpack(f"<{n}I", f"microbatch {k} samples"))
            (nrows,) = reader.unpack("<I", f"microbatch {k} row count")
            rows = list(reader.unpack(f"<{nrows}I", f"microbatch {k} row sizes"))
            saved = header.get("attention_saved", {}).get(str(mid), 0.0)
            saved = _attention_saved(source, saved, f"microbatch {k}")
            mbs.append(MicroBatch(mid, rep, samples, seq, tgt, rows, saved))
        ranks = []
        for k in range(header["num_ranks"]):
            rep, stage, n = reader.unpack("<iiI", f"rank {k}")
            instrs = []
            for i in range(n):
                op, dt, ndim, mb, peer = reader.unpack("<BBBxii", f"rank {k} instruction {i}")
                if op >= len(OPS) or dt > len(DTYPES):
                    raise PlanningError(
                        f"{source}: rank {k} instruction {i}: unknown op/dtype code"
                    )
                shape = reader.unpack(f"<{ndim}i", f"rank {k} instruction {i} shape")
                instrs.append(
                    Instruction(OPS[op], mb, peer, tuple(shape), DTYPES[dt - 1] if dt else "")
                )
            ranks.append(RankPlan(rep, stage, instrs))
        if reader.pos != len(buf):
            raise PlanningError(f"{source}: {len(buf) - reader.pos} trailing bytes after the plan")
        plan = cls(
            header["num_stages"],
            header["num_replicas"],
            mbs,
            ranks,
            header["stats"],
            header["meta"],
            replicas=_layouts(source, header.get("replicas", [])),
        )
        validate_structure(plan, source)
        return plan

    # ---- files ------------------------------------------------------------------------
    def save(self, path: str | Path, fmt: str | None = None) -> None:
        """Write atomically (temporary file + rename): a failed write leaves nothing behind, and
        a plan that would not load is refused before anything is written."""
        path = Path(path)
        validate_structure(self, str(path))
        fmt = fmt or ("bin" if path.suffix == ".bin" else "json")
        if fmt == "json":
            payload = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        elif fmt == "bin":
            payload = self.to_bytes()
        else:
            raise PlanningError(f"unknown plan format {fmt!r}; use json or bin")
        atomic_write(path, payload)


def load_plan(path: str | Path) -> ExecutionPlan:
    """Read a JSON or binary plan (detected by content) with errors that name the file."""
    path = Path(path)
    buf = read_input_file(path, "plan")
    if buf.startswith(MAGIC):
        return ExecutionPlan.from_bytes(buf, str(path))
    data = parse_json_document(
        buf, f"plan {path}", kind=dict, invalid="neither a binary plan nor valid JSON"
    )
    return ExecutionPlan.from_dict(data, str(path))


def atomic_write(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` through a temporary file renamed over it, so that a failed
    write leaves nothing behind. A `path` that exists and is not a regular file (a device, a
    directory, a FIFO, or a link to one) is refused with a `PlanningError`: the rename would
    replace it, turning `/dev/full` into a regular file."""
    if path.exists() and not path.is_file():
        raise PlanningError(f"{path} is not a regular file; give a file path to write to")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _need(source: str, obj: Any, key: str, where: str, kind: type | tuple = int) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise PlanningError(f"{source}: {where} is missing {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PlanningError(f"{source}: {where}.{key} has the wrong type: {value!r}")
    return value


def _optional(source: str, obj: dict, key: str, where: str, default: Any, kind: type = int) -> Any:
    """An optional field: its default when absent, else of the given type."""
    if key not in obj:
        return default
    return _need(source, obj, key, where, kind)


def _integers(source: str, values: Any, where: str) -> list[int]:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise PlanningError(f"{source}: {where} must be a list of integers")
    return values


def _layouts(source: str, raw: Any) -> list[ReplicaLayout]:
    """Parse the "replicas" list of JSON or of a binary header; `validate_structure` judges it."""
    if not isinstance(raw, list):
        raise PlanningError(f"{source}: replicas must be a list of replica layouts")
    need = partial(_need, source)
    layouts = []
    for k, rep in enumerate(raw):
        where = f"replicas[{k}]"
        stages = []
        for n, stage in enumerate(need(rep, "stages", where, list)):
            sw = f"{where}.stages[{n}]"
            layers = _integers(source, need(stage, "layers", sw, list), f"{sw}.layers")
            if len(layers) != 2:
                raise PlanningError(f"{source}: {sw}.layers must be [start, end)")
            devices = _integers(source, need(stage, "devices", sw, list), f"{sw}.devices")
            stages.append(StageLayout(devices, need(stage, "tp", sw), (layers[0], layers[1])))
        layouts.append(
            ReplicaLayout(need(rep, "id", where), need(rep, "num_stages", where), stages)
        )
    return layouts


class _Reader:
    def __init__(self, buf: bytes, source: str) -> None:
        self.buf, self.source, self.pos = buf, source, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise PlanningError(f"{self.source}: truncated at byte {self.pos} while reading {what}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))


def validate_structure(plan: ExecutionPlan, source: str = "plan") -> None:
    """Static checks that need no cost model: layouts, known ops, ranks and micro-batches in
    range, one rank per stage of each replica, communication instructions with a valid peer,
    and shapes/dtypes on every Start."""
    if plan.num_stages < 1 or plan.num_replicas < 1:
        raise PlanningError(f"{source}: num_stages and num_replicas must be >= 1")
    for name in ("stats", "meta"):
        if not isinstance(getattr(plan, name), dict):
            raise PlanningError(f"{source}: {name} must be a mapping")
    for m in plan.microbatches:
        if not (0 < m.seqlen <= MAX_SEQLEN and 0 <= m.tgt_seqlen <= MAX_SEQLEN):
            raise PlanningError(
                f"{source}: micro-batch {m.id}: seqlen {m.seqlen} / tgt_seqlen {m.tgt_seqlen} "
                f"out of range (1 .. {MAX_SEQLEN} / 0 .. {MAX_SEQLEN})"
            )
    _validate_layouts(plan, source)
    mb_replica: dict[int, int] = {}
    for m in plan.microbatches:
        if m.id in mb_replica:
            raise PlanningError(f"{source}: micro-batch id {m.id} appears twice")
        if not 0 <= m.replica < plan.num_replicas:
            raise PlanningError(
                f"{source}: micro-batch {m.id} has replica {m.replica} out of range"
            )
        if not m.samples or m.seqlen <= 0:
            raise PlanningError(f"{source}: micro-batch {m.id} has no samples or seqlen <= 0")
        if m.row_sizes and (sum(m.row_sizes) != len(m.samples) or min(m.row_sizes) < 1):
            raise PlanningError(f"{source}: micro-batch {m.id} row_sizes do not cover its samples")
        if m.attention_saved and not m.row_sizes:
            raise PlanningError(
                f"{source}: micro-batch {m.id} saves attention but has no packed rows (row_sizes)"
            )
        mb_replica[m.id] = m.replica
    seen = set()
    for r in plan.ranks:
        where = f"rank (replica {r.replica}, stage {r.stage})"
        if not 0 <= r.replica < plan.num_replicas:
            raise PlanningError(f"{source}: {where} is out of range")
        depth = plan.replica_num_stages(r.replica)
        if not 0 <= r.stage < depth:
            raise PlanningError(
                f"{source}: {where} is out of range: replica {r.replica} has {depth} stage(s)"
            )
        if (r.replica, r.stage) in seen:
            raise PlanningError(f"{source}: {where} appears twice")
        seen.add((r.replica, r.stage))
        for n, ins in enumerate(r.instructions):
            iw = f"{where} instruction {n} ({ins.op} mb {ins.mb})"
            if ins.op not in _OP_CODE:
                raise PlanningError(f"{source}: {iw}: unknown op; known ops: {', '.join(OPS)}")
            if mb_replica.get(ins.mb) != r.replica:
                raise PlanningError(f"{source}: {iw}: micro-batch not in this rank's replica")
            if ins.op in COMM_OPS:
                expected = r.stage + (
                    1
                    if ins.op in ("SendActStart", "RecvGradStart", "WaitSendAct", "WaitRecvGrad")
                    else -1
                )
                if ins.peer != expected:
                    raise PlanningError(
                        f"{source}: {iw}: peer {ins.peer}, expected stage {expected}"
                    )
                if not 0 <= ins.peer < depth:
                    raise PlanningError(
                        f"{source}: {iw}: peer stage {ins.peer} does not exist; replica "
                        f"{r.replica} has {depth} stage(s)"
                    )
            if ins.op in START_OPS and (not ins.shape or ins.dtype not in DTYPES):
                raise PlanningError(
                    f"{source}: {iw}: a Start needs a shape and a dtype in {DTYPES}"
                )
    # Counted, not listed: a corrupt num_stages of 2**70 must not be enumerated.
    if plan.replicas:
        expected = sum(r.num_stages for r in plan.replicas)
    else:
        expected = plan.num_replicas * plan.num_stages
    if len(seen) != expected:
        wanted = (
            (k, j) for k in range(plan.num_replicas) for j in range(plan.replica_num_stages(k))
        )
        missing = list(itertools.islice(((k, j) for k, j in wanted if (k, j) not in seen), 17))
        listed = ", ".join(f"replica {k} stage {j}" for k, j in missing[:16])
        raise PlanningError(
            f"{source}: {len(seen)} ranks, expected {expected}; no rank plan for "
            f"{listed}{', ...' if len(missing) > 16 else ''}"
        )


def _validate_layouts(plan: ExecutionPlan, source: str) -> None:
    """A heterogeneous plan's layouts: one per replica in id order, as many stages as the
    replica's num_stages, each stage a group of `tp` devices no other stage uses, and each
    replica's stages holding the whole model's layers [0, L) in order, without gap or overlap."""
    if not plan.replicas:
        return
    if len(plan.replicas) != plan.num_replicas:
        raise PlanningError(
            f"{source}: {len(plan.replicas)} replica layouts for num_replicas {plan.num_replicas}"
        )
    owner: dict[int, str] = {}
    num_layers = None
    for k, rep in enumerate(plan.replicas):
        if rep.id != k:
            raise PlanningError(f"{source}: replicas[{k}] has id {rep.id}; ids must be 0..n-1")
        if rep.num_stages < 1 or len(rep.stages) != rep.num_stages:
            raise PlanningError(
                f"{source}: replica {k} lists {len(rep.stages)} stage layout(s) but has "
                f"num_stages {rep.num_stages}"
            )
        layer = 0
        for j, stage in enumerate(rep.stages):
            where = f"replica {k} stage {j}"
            if stage.tp < 1:
                raise PlanningError(f"{source}: {where} has tp {stage.tp}; tp must be >= 1")
            if len(stage.devices) != stage.tp:
                raise PlanningError(
                    f"{source}: {where} has {len(stage.devices)} device(s) for tp {stage.tp}"
                )
            for device in stage.devices:
                if device < 0 or device in owner:
                    used = f"also used by {owner[device]}" if device in owner else "negative"
                    raise PlanningError(f"{source}: {where}: device {device} is {used}")
                owner[device] = where
            start, end = stage.layers
            if start != layer or end <= start:
                raise PlanningError(
                    f"{source}: {where} holds layers [{start}, {end}); it must start at layer "
                    f"{layer} and hold at least one, so that the replica covers [0, L) in order"
                )
            layer = end
        if num_layers is None:
            num_layers = layer
        elif layer != num_layers:
            raise PlanningError(
                f"{source}: replica {k} holds layers [0, {layer}) but replica 0 holds "
                f"[0, {num_layers}); every replica holds the whole model"
            )
    deepest = max(rep.num_stages for rep in plan.replicas)
    if plan.num_stages != deepest:
        raise PlanningError(
            f"{source}: num_stages {plan.num_stages}, but the deepest replica has {deepest}"
        )


def _attention_saved(source: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise PlanningError(f"{source}: {where}.attention_saved must be a number >= 0")
    return float(value)
