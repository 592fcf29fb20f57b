"""SYNTHETIC sequence-length distributions: defaults for when no real dataset is at hand.

The planner's behaviour depends on the shape of the length distribution (dynapipe.txt §2.1:
FLANv2 mixes tasks whose mean input length ranges from ~50 tokens for NLI to ~980 for
CNN/DailyMail, with a long tail truncated at 65536), but the project ships no dataset. These
presets are hand-made stand-ins with that kind of shape, for tests, benchmarks and CLI defaults.
None of them is measured from real data; every number below is an assumption.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import PlanningError
from .batching import truncate
from .validation import check_count

FLAN_MAX_LENGTH = 65536


@dataclass(frozen=True)
class _TaskFamily:
    """One lognormal task family of the FLAN-like mix (medians in tokens)."""

    name: str
    weight: float
    median: float
    sigma: float
    target_median: float
    target_sigma: float


_FLAN_FAMILIES = (
    _TaskFamily("classification/NLI", 0.35, 60, 0.5, 3, 0.6),
    _TaskFamily("QA", 0.30, 180, 0.6, 12, 0.8),
    _TaskFamily("reasoning/CoT", 0.20, 400, 0.5, 90, 0.7),
    _TaskFamily("summarization/long-context", 0.15, 1000, 1.1, 60, 0.6),
)


def _lognormal(
    rng: np.random.Generator, median: np.ndarray | float, sigma: np.ndarray | float, size: int
) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(size))


def _as_lengths(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.clip(np.rint(values), lo, hi).astype(np.int64)


def _flan(rng: np.random.Generator, n: int, with_targets: bool) -> np.ndarray:
    """Each sample draws a task family, then lognormal input (and target) lengths from it."""
    weights = np.array([f.weight for f in _FLAN_FAMILIES])
    family = rng.choice(len(_FLAN_FAMILIES), size=n, p=weights / weights.sum())

    def column(attribute: str) -> np.ndarray:
        return np.array([getattr(f, attribute) for f in _FLAN_FAMILIES])[family]

    inputs = _lognormal(rng, column("median"), column("sigma"), n)
    lengths = _as_lengths(inputs, 1, FLAN_MAX_LENGTH)
    if not with_targets:
        return lengths
    targets = _lognormal(rng, column("target_median"), column("target_sigma"), n)
    return np.stack([lengths, _as_lengths(targets, 1, FLAN_MAX_LENGTH)], axis=1)


def _webcode(
    rng: np.random.Generator, n: int, with_targets: bool, *, code_fraction: float = 0.3
) -> np.ndarray:
    """Web pages (lognormal, median 500, sigma 1.2) and code files (Lomax tail, alpha 1.2)."""
    if with_targets:
        raise PlanningError("preset 'webcode' is decoder-only data and has no target lengths")
    if not 0.0 <= code_fraction <= 1.0:
        raise PlanningError(f"webcode: code_fraction must be in [0, 1], got {code_fraction}")
    is_code = rng.random(n) < code_fraction
    web = _lognormal(rng, 500.0, 1.2, n)
    code = 300.0 * (1.0 + rng.pareto(1.2, n))  # median ~530; ~0.4% of files beyond 30k tokens
    return _as_lengths(np.where(is_code, code, web), 1, 32768)


def _parametric_lognormal(
    rng: np.random.Generator,
    n: int,
    with_targets: bool,
    *,
    median: float = 256.0,
    sigma: float = 1.0,
    lo: float = 8,
    hi: float = 4096,
    target_median: float = 32.0,
    target_sigma: float = 1.0,
) -> np.ndarray:
    """Lognormal(median, sigma) clipped to [lo, hi]; targets lognormal with the same clip."""
    if median <= 0 or target_median <= 0 or sigma < 0 or target_sigma < 0 or not 1 <= lo <= hi:
        raise PlanningError(
            "lognormal: need median, target_median > 0, sigma, target_sigma >= 0 and "
            f"1 <= lo <= hi; got median={median}, sigma={sigma}, lo={lo}, hi={hi}, "
            f"target_median={target_median}, target_sigma={target_sigma}"
        )
    lengths = _as_lengths(_lognormal(rng, median, sigma, n), lo, hi)
    if not with_targets:
        return lengths
    targets = _as_lengths(_lognormal(rng, target_median, target_sigma, n), lo, hi)
    return np.stack([lengths, targets], axis=1)


@dataclass(frozen=True)
class _Preset:
    description: str
    draw: Callable[..., np.ndarray]


_PRESETS = {
    "flan": _Preset(
        "SYNTHETIC FLAN-like multi-task mix: lognormal task families, classification/NLI "
        "(median 60 tokens, 35%), QA (180, 30%), reasoning/CoT (400, 20%), "
        "summarization/long-context (1000, sigma 1.1 heavy tail, 15%), capped at 65536; "
        "short per-family targets (medians 3-90) for encoder-decoder models.",
        _flan,
    ),
    "webcode": _Preset(
        "SYNTHETIC web/code mix: web text lognormal (median 500, sigma 1.2) and a code_fraction "
        "(default 0.3) of code files with a Pareto-like tail, capped at 32768; decoder-only.",
        _webcode,
    ),
    "commoncrawl": _Preset(
        "SYNTHETIC CommonCrawl-like web text: lognormal (median 500, sigma 1.2) capped at 32768 "
        "(the web part of 'webcode'); decoder-only.",
        lambda rng, n, with_targets: _webcode(rng, n, with_targets, code_fraction=0.0),
    ),
    "lognormal": _Preset(
        "SYNTHETIC parametric lognormal(median=256, sigma=1) clipped to [lo=8, hi=4096] "
        "(the planner benchmark default); targets lognormal(target_median=32, target_sigma=1) "
        "with the same clip.",
        _parametric_lognormal,
    ),
}

PRESETS: dict[str, str] = {name: preset.description for name, preset in _PRESETS.items()}


def sample_lengths(
    preset: str,
    num_samples: int,
    *,
    seed: int = 0,
    max_seqlen: int | None = None,
    with_targets: bool = False,
    **params: float,
) -> np.ndarray:
    """SYNTHETIC lengths from a named preset (see `PRESETS`): int64, (N,) or (N, 2) with targets.

    The same seed gives the same lengths, and input lengths do not depend on `with_targets`.
    `max_seqlen` truncates as a training job would; `params` override the preset's parameters.
    """
    if preset not in _PRESETS:
        raise PlanningError(f"unknown length preset {preset!r}; known: {', '.join(_PRESETS)}")
    num_samples = check_count(num_samples, "num_samples", 1)
    rng = np.random.default_rng(check_count(seed, "seed", 0))
    draw = _PRESETS[preset].draw
    _check_params(preset, draw, params)
    lengths = draw(rng, num_samples, with_targets, **params)
    return lengths if max_seqlen is None else truncate(lengths, max_seqlen)


def _check_params(preset: str, draw: Callable[..., np.ndarray], params: dict[str, object]) -> None:
    """Only the preset's own keyword parameters, and only real numbers."""
    accepted = [
        p.name for p in inspect.signature(draw).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PlanningError(
            f"preset {preset!r} has no parameter(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted) or 'none'}"
        )
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
            raise PlanningError(f"preset {preset!r}: {name} must be a finite number, got {value!r}")
