"""``pipeline.recat_cache``: torchrec's recat index tensors made once per splits layout.

torchrec's ``KJTAllToAllTensorsAwaitable`` makes its recat indices with
``torch.tensor(list, device=cuda)`` at every input dist, one per sharding group and batch
(torchrec 1.6.1 to 1.8: ``dist_data._get_recat``): a copy from pageable host memory that
is not asynchronous, so the host waits there for the stream the input dist runs on (the
dist stream, with the all-to-alls queued on it). The indices depend only on the splits
(features per rank, ranks, stagger, batch size per rank), so :class:`RecatCache` makes
each once and hands the same device tensor back after: the same values, no copy, no wait.

The step graph always uses one (a captured step must not copy from pageable memory);
``pipeline.recat_cache`` installs one around every step of the other pipelines.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from recpipe.compat.torchrec import recat_function, recat_replaced

__all__ = ["RecatCache", "RecatCacheHandle", "apply"]


class RecatCache:
    """Stands in for torchrec's ``dist_data._get_recat`` while installed (see the module
    docstring): each layout's recat tensor is made once and reused, the ``LAYOUTS`` most
    first kept (variable batch sizes per rank make a layout per combination; later ones
    are made at each call, as without the cache). In a step
    graph the captured step reads the same device tensor at every replay. One first asked
    for during a capture is made on the host, pinned and copied (a captured copy from
    pinned memory, kept alive here)."""

    LAYOUTS = 64

    def __init__(self) -> None:
        self._original = recat_function()
        self._made: dict[tuple, Any] = {}
        self._pinned: list[torch.Tensor] = []
        self.made = 0  # recat tensors made
        self.calls = 0  # recat tensors asked for (the calls not making one were answered from the cache)

    def __call__(self, local_split: int, num_splits: int, stagger: int = 1, device: Any = None,
                 batch_size_per_rank: Any = None) -> Any:
        self.calls += 1
        key = (local_split, num_splits, stagger, str(device), tuple(batch_size_per_rank or ()))
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if key not in self._made and len(self._made) >= self.LAYOUTS and not capturing:
            # full: made anew, as torchrec does (a cached tensor is never freed while steps on
            # other streams may still read it)
            return self._original(local_split, num_splits, stagger, device, batch_size_per_rank)
        if key not in self._made:
            self.made += 1
            device = torch.device(device) if device is not None else None
            if device is not None and device.type == "cuda" and capturing:
                host = self._original(local_split, num_splits, stagger, torch.device("cpu"), batch_size_per_rank)
                if host is not None:
                    host = host.pin_memory()
                    self._pinned.append(host)
                    self._made[key] = host.to(device, non_blocking=True)
                else:
                    self._made[key] = None
            else:
                self._made[key] = self._original(local_split, num_splits, stagger, device, batch_size_per_rank)
        return self._made[key]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with recat_replaced(self):
            yield


class RecatCacheHandle:
    """What :func:`apply` installed: a :class:`RecatCache` around every step of a pipeline."""

    def __init__(self, cache: RecatCache, steps: int) -> None:
        self.cache, self.steps, self.removed = cache, steps, False

    def __repr__(self) -> str:
        return (f"recat cache: torchrec's recat indices made once per layout around {self.steps} steps "
                f"({self.cache.made} made; recpipe.speedups.recat_cache)")

    def remove(self) -> None:
        self.removed = True


def apply(ctx: Any, options: Any) -> RecatCacheHandle:
    """The speed feature's entry point (``recpipe.speedups.defs.recat_cache``): every step of
    the pipeline of ``ctx`` runs with one :class:`RecatCache` installed (``ctx.wrap_step``)."""
    cache = RecatCache()
    names = sorted({s.name for schedule in ctx.pipeline.schedules() for s in schedule.steps})
    handle = RecatCacheHandle(cache, len(names))

    def with_cache(fn: Callable) -> Callable:
        def step(c: Any, b: Any) -> None:
            if handle.removed:
                return fn(c, b)
            with cache.installed():
                fn(c, b)

        return step

    for name in names:
        ctx.wrap_step(name, with_cache)
    return handle
