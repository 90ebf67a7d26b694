"""``recpipe bench``: step time, throughput, GPU busy time and memory of every pipeline,
recpipe's and (``--with-torchrec``) TorchRec's, on identical models and batches.

``runner`` the orchestration (one ``run_worker`` per rank, rounds interleaved; ``launch``;
the flags are ``recpipe.cli``'s), ``run`` one timed run on one rank and its typed ``RunResult``,
``measure`` the one clock and the allocator snapshots, ``trace`` what a torch.profiler
trace of the steps after the timed ones says, ``uvm_cache`` FBGEMM's cache counters,
``torchrec_impl`` TorchRec's pipeline for each of recpipe's, ``compare`` rounds and paired
ratios, ``report`` / ``sections`` / ``plots`` the record. Each module's ``__all__`` is its
public API (the studies in benchmarks/studies/ use nothing else); docs/benchmarking.md says
what each number means. Nothing is imported here, so ``recpipe --help`` stays light.
"""
