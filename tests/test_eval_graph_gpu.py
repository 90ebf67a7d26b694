"""The evaluation's captured forward of ``pipeline.step_graph`` on CUDA, on 1 and 2 GPUs:
real graphs (``capture_with_torch``) for the training step and the eval forward. The
graphed evaluation's outputs (logits, labels, weights) and metrics equal the eager
evaluation's (the plain loop on the same model) bit for bit, in its first pass (warm-up,
capture) and its second (replays only), with batches over capacity and of other shapes
run eagerly; training after it continues exactly as after the plain loop. The worker is
tests/test_eval_graph.py's."""

from __future__ import annotations

import pytest
import torch

from pipeline_harness import small_config
from recpipe.launcher import launch_local
from recpipe.speedups.step_graph import capture_with_torch
from test_eval_graph import _worker
from test_step_graph import ROW_TABLES, TABLES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("name", ["base", "sparse_dist"])
@pytest.mark.parametrize("nproc,tables", [(1, TABLES), (2, TABLES), (2, ROW_TABLES)],
                         ids=["1-table_column_wise", "2-table_column_wise", "2-every_type"])
def test_eval_graph_replays_give_the_eager_evaluation(nproc, tables, name):
    launch_local(_worker, nproc, small_config(nproc, ["train.device=cuda", *tables]), name, capture_with_torch)
