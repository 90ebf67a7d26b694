"""recpipe: training pipelines for sharded recommendation models."""

__version__ = "0.1.0"
