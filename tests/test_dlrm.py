"""recpipe's DLRM: the pooled embeddings' [B, F, D] layout (``pooled_BFD``) equals
torchrec's SparseArch (``to_dict`` and a ``cat`` of F tensors) to the bit, forward and
backward, whatever order the KeyedTensor's keys come in."""

from __future__ import annotations

import pytest
import torch
import torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recpipe.config import load_config
from recpipe.data.batch import Batch
from recpipe.models.dlrm import build_model, pooled_BFD

NAMES = ["f0", "f1", "f2", "f3"]
B, D = 5, 3


def _torchrec_layout(kt: KeyedTensor, names: list[str], dim: int) -> torch.Tensor:
    """torchrec.models.dlrm.SparseArch.forward after its lookup."""
    by_key = kt.to_dict()
    return torch.cat([by_key[n] for n in names], dim=1).reshape(-1, len(names), dim)


def _keyed(keys: list[str], dims: list[int]) -> tuple[KeyedTensor, torch.Tensor]:
    values = torch.randn(B, sum(dims), generator=torch.Generator().manual_seed(len(keys))).requires_grad_()
    return KeyedTensor(keys=keys, length_per_key=dims, values=values), values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize("keys", [NAMES, ["f2", "f0", "f3", "f1"]], ids=["feature_order", "permuted"])
def test_layout_and_gradient_equal_torchrecs_to_the_bit(keys):
    got_kt, got_values = _keyed(keys, [D] * 4)
    want_kt, want_values = _keyed(keys, [D] * 4)
    got, want = pooled_BFD(got_kt, NAMES, D), _torchrec_layout(want_kt, NAMES, D)
    assert got.shape == (B, 4, D) and torch.equal(_bits(got), _bits(want))
    if keys == NAMES:
        assert got.data_ptr() == got_values.data_ptr()  # a view: no copy, no kernel
    grad = torch.randn(B, 4, D)
    grad[0, 1, 2] = -0.0  # a layout change keeps the sign of zero
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(_bits(got_values.grad), _bits(want_values.grad))


@pytest.mark.parametrize("keys,dims", [(NAMES, [3, 2, 3, 3]), (["f0", "f1", "f2", "f9"], [D] * 4)],
                         ids=["mixed_dims", "other_keys"])
def test_other_keyed_tensors_take_torchrecs_path(keys, dims):
    kt, _ = _keyed(keys, dims)
    if keys != NAMES:  # a key the model does not have: torchrec's KeyError, not a silent layout
        with pytest.raises(KeyError, match="f3"):
            pooled_BFD(kt, NAMES, D)
        return
    names, dim = ["f1"], 2
    assert torch.equal(pooled_BFD(kt, names, dim), _torchrec_layout(kt, names, dim))


def test_the_model_traces_under_torchrecs_fx_tracer_and_runs_the_same():
    cfg = load_config(None, ["model.num_embeddings_per_feature=[10, 10, 10]", "model.embedding_dim=4",
                             "model.dense_arch_layer_sizes=[8, 4]", "model.over_arch_layer_sizes=[8, 1]"])
    torch.manual_seed(0)
    model = build_model(cfg.model, device=torch.device("cpu"))
    kjt = KeyedJaggedTensor(keys=cfg.model.feature_names, values=torch.tensor([1, 2, 3, 4, 5, 6]),
                            lengths=torch.tensor([1, 1, 1, 1, 1, 1], dtype=torch.int32))
    batch = Batch(torch.randn(2, cfg.model.num_dense_features), kjt, torch.tensor([0.0, 1.0]), torch.ones(2))
    graph = torchrec.fx.symbolic_trace(model)
    assert any(node.target is pooled_BFD for node in graph.graph.nodes)
    assert torch.equal(graph(batch)[0], model(batch)[0])
