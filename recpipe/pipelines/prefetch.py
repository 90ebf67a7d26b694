"""The engine class of ``prefetch`` (its schedule and why: ``recpipe.pipelines.defs.prefetch``):
finds the model's locked UVM caches when it is built, and releases the cache lines that
forwards outside the pipeline locked when a ``detached()`` block ends."""

from __future__ import annotations

from recpipe.errors import job_warning
from recpipe.pipelines.defs import prefetch as prefetch_def
from recpipe.runtime.engine import Pipeline
from recpipe.runtime.sharded import cached_tbes

__all__ = ["PrefetchPipeline", "cached_tbes"]


class PrefetchPipeline(Pipeline):
    definition = prefetch_def.PIPELINE

    def __init__(self, model, optimizer, device, **options) -> None:
        super().__init__(model, optimizer, device, **options)
        self.tbes = cached_tbes(model)
        if not self.tbes:
            job_warning(
                "prefetch pipeline: the model has no UVM-cached table with prefetch_pipeline, so the prefetch "
                "step does nothing (the schedule still runs, as in CPU tests)",
                stacklevel=2,
            )

    def after_detached_run(self) -> None:
        """Release cache locks taken by forwards outside the pipeline.

        With no batch in flight every legitimate lock has been released by its
        backward, so any count left comes from eval/no-grad forwards: zero it."""
        assert not self.in_flight()
        for tbe in cached_tbes(self.model):
            tbe.lxu_cache_locking_counter.zero_()
            tbe.lxu_cache_locations_list.clear()
            tbe.timesteps_prefetched.clear()
