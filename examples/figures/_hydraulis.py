"""Hydraulis end-to-end runs shared by the Hydraulis Fig. 10 and Fig. 13 scripts: each setting
is `benchmarks/hydraulis_quality.py`'s `setting` (imported), with few iterations."""

from __future__ import annotations

from benchmarks.hydraulis_quality import setting

METHODS = {
    "megatron": "Megatron-style",
    "dp_balanced (re-implemented)": "Megatron-LM dp_balanced (re-implemented)",
    "cost-aware dp-balanced": "cost-aware DP-balanced (ours)",
    "hotspa": "HotSPa-style",
    "(a) dispatch+max": "(a) homogeneous + dispatch, pack to MaxLen",
    "(b) +Eq.1 pack": "(b) + Eq. 1 packing",
    "(c) +hetero": "(c) + static heterogeneous strategy",
    "(d) +selection": "(d) + per-iteration selection = Hydraulis",
    "(e) +DynaPipe=ours": "(e) + DynaPipe micro-batching (ours)",
}


def setting_rows(
    model: str, gpus: int, context: int, iterations: int, trials: int, tokens: int
) -> list[dict]:
    results, chosen, tokens, _pricings = setting(model, gpus, context, iterations, trials, tokens)
    return [
        {
            "model": model,
            "gpus": gpus,
            "context": context,
            "tokens_per_iteration": tokens,
            "iterations": iterations,
            "method": method,
            "latency_s": round(latency, 4),
            "tokens_per_s": round(tokens / latency, 1),
            "imbalance": round(imbalance, 4),
            "scheme": str(chosen.get(method, "")),
        }
        for method, (latency, imbalance) in results.items()
    ]
