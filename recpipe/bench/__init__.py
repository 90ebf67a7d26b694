"""``recpipe bench``: step time, throughput and memory of every pipeline, recpipe's
and (``--with-torchrec``) TorchRec's, on identical models and batches.

``runner`` orchestrates (CLI entry ``main_bench``, one ``run_worker`` per rank),
``run`` is one timed run on one rank, ``measure`` owns the clocks and allocator
snapshots, ``trace`` reads a torch.profiler trace of the steps after the timed ones
(GPU busy time, host time by phase, cache work), ``uvm_cache`` FBGEMM's cache
counters, ``torchrec_impl`` maps each recpipe pipeline to TorchRec's, ``compare``
merges rounds and checks targets, ``report`` writes ``bench.json`` / ``bench.md``.
Optional sections: ``bound`` (``--bound``: each stage alone, an estimate),
``multipass`` (``--multipass``: prefetch passes sweep), ``sweep`` (``--sweep-cache`` /
``--sweep-zipf``: prefetch vs sparse_dist), ``weak_scaling`` (samples/s per GPU,
``--baseline``), rendered by ``sections``; ``plots`` draws the PNGs.
"""

from recpipe.bench.runner import BenchOptions, main_bench, run_worker

__all__ = ["BenchOptions", "main_bench", "run_worker"]
