"""``pipeline.recat_cache``: torchrec's recat index tensors made once per splits layout
instead of at every input dist (a copy from pageable host memory the host waits for);
the implementation is ``recpipe.speedups.recat_cache``."""

from __future__ import annotations

from recpipe.sections import SwitchSection
from recpipe.speedups.definition import SpeedupDef

__all__ = ["FEATURE", "RecatCacheOptions"]


class RecatCacheOptions(SwitchSection):
    """``pipeline.recat_cache``: make torchrec's recat indices once per splits layout
    (features per rank, ranks, batch size per rank) and reuse them, where torchrec makes
    them at every input dist with a host-to-device copy the host waits for. The same
    values: training is unchanged. ``true`` / ``false`` stand for ``{enabled: true}`` /
    ``{enabled: false}``. The step graph always uses it."""

    # Reuse the recat tensors (every pipeline; the step graph's own is always on).
    enabled: bool = False


FEATURE = SpeedupDef(
    "recat_cache", RecatCacheOptions,
    "torchrec's recat indices made once per splits layout (recpipe/speedups/recat_cache.py)",
    apply="recpipe.speedups.recat_cache:apply",
)
