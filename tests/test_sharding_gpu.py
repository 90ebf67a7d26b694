"""Every module type shards every sharding type on CUDA (NCCL, 1 and 2 GPUs) and
computes what the unsharded model computes; on CUDA that includes data_parallel
EmbeddingCollection tables, which FBGEMM's CPU kernel cannot run.

    python -m pytest -m gpu -q tests/test_sharding_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from recpipe.launcher import launch_local
from test_sharding import SPARSE_NN, TWO_TOWER, _cfg, _shard_and_compare_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TWO_TOWER_CUDA = (TWO_TOWER[0], {**TWO_TOWER[1], "t_history_brand": "data_parallel"}, TWO_TOWER[2])


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("model", [SPARSE_NN, TWO_TOWER_CUDA], ids=["TestSparseNN", "two_tower_with_EC"])
def test_every_module_shards_every_type_on_cuda(model, nproc):
    name, tables, options = model
    cfg = _cfg(name, tables, options, nproc=nproc, extra=("train.device=cuda",))
    launch_local(_shard_and_compare_worker, nproc, cfg, name, f"{name}_batches", 1e-5)
