"""``pipeline.splits_exchange: host``: the splits of each batch's input all-to-all exchanged
over a Gloo group from host memory; the implementation is ``recpipe.speedups.splits_exchange``
(the exchange itself: ``recpipe.runtime.sharded.HostSplitsExchange``)."""

from __future__ import annotations

from recpipe.capabilities import INTERCEPTS
from recpipe.speedups.definition import SpeedupDef

__all__ = ["FEATURE"]

FEATURE = SpeedupDef(
    "splits_exchange", None,
    "the splits of the input all-to-all exchanged on the host, over a Gloo group (recpipe/speedups/splits_exchange.py)",
    apply="recpipe.speedups.splits_exchange:apply", needs=frozenset({INTERCEPTS}), missing="skip",
    key="splits_exchange",
)
