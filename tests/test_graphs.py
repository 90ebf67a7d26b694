"""The CUDA-graph wiring of recpipe.speedups.cuda_graphs, on CPU with a stand-in capture
(the real capture, torch.cuda.make_graphed_callables, and the numerics are checked on
the GPU by tests/test_pipelines_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recpipe.config import ConfigError, load_config
from recpipe.preflight import Machine, check_machine
from recpipe.models.dlrm import build_model
from recpipe.pipelines import PipelineError
from recpipe.speedups.cuda_graphs import GraphedPart, graph_parts, install, remove


class FakeCapture:
    """Records captures; the 'graphed' callable runs the module's own forward into one
    static buffer and returns that buffer, as a replayed graph's outputs alias its
    static outputs (the next replay overwrites them)."""

    def __init__(self):
        self.captured = []

    def __call__(self, module, sample_args):
        self.captured.append([tuple(a.shape) for a in sample_args])
        static = {}

        def graphed(*args):
            out = type(module).forward(module, *args).detach()
            static.setdefault("buf", torch.empty_like(out)).copy_(out)
            return static["buf"]

        return graphed


def test_a_part_captures_once_replays_falls_back_and_clones_outputs():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    capture = FakeCapture()
    part = GraphedPart("lin", lin, capture)
    install([part])
    x = torch.randn(8, 4)
    y1 = lin(x)
    y2 = lin(x * 2)
    assert capture.captured == [[(8, 4)]] and part.replays == 2
    # Outputs are clones: the second replay did not overwrite the first step's output.
    assert torch.equal(y1, nn.functional.linear(x, lin.weight, lin.bias))
    assert not torch.equal(y1, y2)
    with pytest.warns(UserWarning, match="run eagerly"):
        lin(torch.randn(5, 4))  # another batch size: eager, once warned
    assert part.eager_calls == 1 and len(capture.captured) == 1
    lin.eval()
    lin(x)  # eval: the module's own forward, no replay
    assert part.replays == 2
    lin.train()
    with torch.no_grad():
        lin(x)
    assert part.replays == 2
    with pytest.raises(PipelineError, match="positional tensors only"):
        lin(x=x)
    remove([part])
    assert "forward" not in vars(lin)


def test_capture_failures_and_bad_modules_are_named():
    def broken(module, sample):
        raise RuntimeError("operation not permitted when stream is capturing")

    part = GraphedPart("syncing", nn.Linear(2, 2), broken)
    install([part])
    with pytest.raises(PipelineError, match="cannot capture module 'syncing'.*host"):
        part.module(torch.randn(3, 2))
    hooked = nn.Linear(2, 2)
    hooked.register_forward_hook(lambda *a: None)
    with pytest.raises(PipelineError, match="module hooks"):
        GraphedPart("hooked", hooked)


def test_recpipe_models_offer_their_dense_parts_and_paths_are_checked():
    cfg = load_config(None, ["model.num_embeddings_per_feature=[10, 10]", "model.embedding_dim=8",
                             "model.dense_arch_layer_sizes=[16, 8]"])
    model = build_model(cfg.model, device=torch.device("cpu"))
    parts = graph_parts(model, [])
    assert [p.name for p in parts] == ["dense_arch", "head"]
    assert [p.name for p in graph_parts(model, ["model.over_arch"])] == ["model.over_arch"]
    with pytest.raises(PipelineError, match="'model.nope'.*children"):
        graph_parts(model, ["model.nope"])
    with pytest.raises(PipelineError, match="sharded modules|does not say"):
        graph_parts(nn.Sequential(nn.Linear(2, 2)), [])


def test_cuda_graphs_config_needs_cuda():
    cfg = load_config(None, ["pipeline.name=sparse_dist", "pipeline.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="pipeline.cuda_graphs=true needs a CUDA GPU"):
        check_machine(cfg, Machine(cuda=False))
