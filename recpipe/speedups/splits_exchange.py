"""``pipeline.splits_exchange: host``: the splits all-to-all of every input dist over a
Gloo group of the same ranks, from host memory (``recpipe.runtime.sharded.HostSplitsExchange``).

The ``input_dist`` step installs the fused splits exchange on the first batch whose input
dists exist (``recpipe.runtime.sharded.install_splits_only``); this feature wraps the step
(``ctx.wrap_step``, and ``ctx.wrap_eval_step`` for the evaluations' input dists) so that
the exchange it installs is the host one, before any batch uses it.
"""

from __future__ import annotations

from typing import Any, Callable

from recpipe.runtime.sharded import install_splits_only

__all__ = ["HostSplits", "apply"]


class HostSplits:
    """What :func:`apply` installed: the ``input_dist`` step's fused splits exchange on the host."""

    def __init__(self) -> None:
        self.removed = False

    def __repr__(self) -> str:
        return "splits exchange: on the host, over a Gloo group (recpipe.speedups.splits_exchange)"

    def remove(self) -> None:
        """The exchange installed from now on is the device one (at the next attach)."""
        self.removed = True

    def wrap(self, fn: Callable) -> Callable:
        def input_dist(ctx: Any, b: Any) -> None:
            fused = ctx.splits_fused
            fn(ctx, b)
            if ctx.splits_fused and not fused and not self.removed:  # just installed: on the host instead
                install_splits_only(ctx.modules, host=True)

        return input_dist


def apply(ctx: Any, exchange: str) -> HostSplits | None:
    """The speed feature's entry point (``recpipe.speedups.defs.splits_exchange``): ``exchange``
    is ``pipeline.splits_exchange``; ``"device"`` (torchrec's way) installs nothing."""
    if exchange != "host":
        return None
    handle = HostSplits()
    if any(s.name == "input_dist" for schedule in ctx.pipeline.schedules() for s in schedule.steps):
        ctx.wrap_step("input_dist", handle.wrap)
    ctx.wrap_eval_step("input_dist", handle.wrap)
    return handle
