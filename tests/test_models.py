"""recpipe's DLRM forward: the pooled embeddings as a view of torchrec's KeyedTensor
(``sparse_arch_forward``) give torchrec's ``SparseArch`` values and gradients bit for
bit, without its ``to_dict`` + ``cat``; a KeyedTensor in another key order takes
torchrec's path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recpipe.config import ModelConfig
from recpipe.models.dlrm import build_model, sparse_arch_forward

MODEL = ModelConfig(embedding_dim=8, num_embeddings_per_feature=[30, 20, 10], dense_arch_layer_sizes=[16, 8],
                    over_arch_layer_sizes=[16, 1])


def _features(B: int = 16) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 3, (3 * B,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=MODEL.feature_names, values=values, lengths=lengths)


def _grads(arch, out: torch.Tensor) -> list[torch.Tensor]:
    weight = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)  # a gradient that tells features apart
    grads = torch.autograd.grad((out * weight).sum(), list(arch.parameters()))
    return [g.to_dense() for g in grads]


@pytest.mark.parametrize("arch_name", ["dlrm", "dcn"])
def test_view_of_the_pooled_embeddings_is_torchrec_s_sparse_arch_bit_for_bit(arch_name, monkeypatch):
    torch.manual_seed(0)
    arch = build_model(MODEL.model_copy(update={"arch": arch_name}), device=torch.device("cpu")).model.sparse_arch
    features = _features()
    want = arch(features)  # torchrec: to_dict, then cat in feature order
    want_grads = _grads(arch, want)

    def no_split(self):
        raise AssertionError("the view path must not split the KeyedTensor")

    with monkeypatch.context() as m:
        m.setattr(KeyedTensor, "to_dict", no_split)
        got = sparse_arch_forward(arch, features)
        got_grads = _grads(arch, got)
    assert got.shape == (16, 3, 8)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def test_a_keyed_tensor_in_another_order_takes_torchrec_s_path():
    torch.manual_seed(0)
    arch = build_model(MODEL, device=torch.device("cpu")).model.sparse_arch
    features = _features()
    kt = arch.embedding_bag_collection(features)
    order = [2, 0, 1]
    keys = [kt.keys()[i] for i in order]
    shuffled = KeyedTensor.from_tensor_list(keys, [kt[k] for k in keys])
    shuffled_arch = SimpleNamespace(embedding_bag_collection=lambda _: shuffled, sparse_feature_names=arch.sparse_feature_names,
                                    F=arch.F, D=arch.D)
    got = sparse_arch_forward(shuffled_arch, features)
    assert torch.equal(got, arch(features))
    assert not torch.equal(got, shuffled.values().reshape(-1, 3, 8))  # the view would have mixed features up
