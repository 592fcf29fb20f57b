"""`--device-speed`: emulated slower GPUs on CPU ranks, so heterogeneous layouts can be tested
without a heterogeneous cluster.

HexiScale (seed `hexiscale.txt` §3) and Hydraulis (`hydraulis.txt` §5) pay off when devices
differ in speed. On CPU ranks this is emulation only: after each ForwardPass and BackwardPass
on rank r the executor sleeps (F_r - 1) x the compute time it just measured, so rank r's compute
takes F_r times as long (communication and the optimiser are not slowed). `R0:F0,R1:F1,...`
sets factors by rank (unlisted ranks: 1); a bare list `F0,F1,...` gives every rank's factor.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class DeviceSpeedError(ValueError):
    """A malformed `--device-speed` value; names the offending item."""


def parse_device_speed(text: str | None, world_size: int) -> list[float]:
    """Slowdown factor of every rank (>= 1 is slower; 1 everywhere for None)."""
    factors = [1.0] * world_size
    if not text:
        return factors
    items = [item.strip() for item in text.split(",") if item.strip()]
    keyed = [":" in item for item in items]
    if any(keyed) and not all(keyed):
        raise DeviceSpeedError(f"--device-speed {text!r}: mix of RANK:FACTOR and bare factors")
    if not all(keyed) and len(items) != world_size:
        raise DeviceSpeedError(
            f"--device-speed {text!r} lists {len(items)} factor(s) for {world_size} ranks"
        )
    for position, item in enumerate(items):
        rank_text, _, factor_text = item.rpartition(":") if ":" in item else ("", "", item)
        try:
            rank = int(rank_text) if rank_text else position
            factor = float(factor_text)
        except ValueError as err:
            raise DeviceSpeedError(f"--device-speed item {item!r} is not RANK:FACTOR") from err
        if not 0 <= rank < world_size:
            raise DeviceSpeedError(
                f"--device-speed item {item!r}: rank {rank} is outside 0..{world_size - 1}"
            )
        if not factor > 0:
            raise DeviceSpeedError(f"--device-speed item {item!r}: the factor must be > 0")
        factors[rank] = factor
    return factors


def paced[T](slowdown: float, compute: Callable[..., T], *args: object) -> T:
    """Run `compute(*args)`, then sleep so it took `slowdown` times as long (none when <= 1)."""
    started = time.perf_counter()
    result = compute(*args)
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * (time.perf_counter() - started))
    return result
