"""``recpipe bench`` (docs/benchmarking.md). Each module's ``__all__`` is its public API, the one the
studies in benchmarks/studies/ build on; nothing is imported here, so ``recpipe --help`` stays light."""
