"""Studies on top of ``recpipe bench``'s public API (README.md here says what each measures
and how to run it). Each module is also a script: ``python benchmarks/studies/X.py --help``."""
