"""Pipelined evaluation on CUDA streams (NCCL), one, two and four GPUs: outputs and metrics equal
the plain loop's bit for bit and training after it continues exactly (the worker of
tests/test_eval_pipeline.py) for ``sparse_dist`` and ``fused_sparse_dist``, ``sparse_dist``
with its dense part replayed as CUDA graphs (eager in eval), and ``prefetch`` on UVM-cached
tables (a cache of 2 % of the rows, Zipf ids: evictions and conflict misses in the eval
prefetches), whose eval locks are all released afterwards."""

from __future__ import annotations

import pytest
import torch

from pipeline_harness import small_config
from recpipe.launcher import launch_local
from test_eval_pipeline import TABLES, _worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CACHED_ROWS = [2000, 3000, 4000, 5000]


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_pipelined_eval_equals_the_plain_loop_on_cuda(nproc):
    hbm = small_config(nproc, ["train.device=cuda", *TABLES])
    launch_local(_worker, nproc, hbm, (("sparse_dist", {}), ("fused_sparse_dist", {}),
                                       ("sparse_dist", {"cuda_graphs": True})))
    cached = small_config(nproc, [
        "train.device=cuda",
        f"model.num_embeddings_per_feature={CACHED_ROWS}",
        "data.batch_size=256",
        "data.synthetic.zipf_alpha=1.1",
        "data.synthetic.mean_pooling_factors=3.0",
        "sharding.default={type: table_wise, kernel: fused_uvm_caching, cache_load_factor: 0.02}",
        "sharding.tables={t_cat_1: {type: row_wise, kernel: fused_uvm_caching, cache_load_factor: 0.02}}",
        "sharding.uvm_host_mapped=true",
        "pipeline.name=prefetch",
    ])
    launch_local(_worker, nproc, cached, (("prefetch", {}), ("prefetch", {"cache_fill": False})), True)
