"""recpipe: training pipelines for sharded recommendation models."""

from recpipe import quiet as _quiet

__version__ = "0.1.0"

_quiet.install()  # fbgemm-gpu's "_fbgemm_torch_compat_table has no entry" (recpipe/quiet.py)
