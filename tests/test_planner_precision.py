"""The planner's activation terms follow ``train.precision``: the bytes autograd
really saves per sample (saved-tensor hooks on CPU, under CPU autocast for bf16)
against ``spec.activation_bytes``, and the plan's activation terms scale with it."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.config import ModelConfig, load_config
from recpipe.models import build_model
from recpipe.models.dlrm import sparse_arch_forward
from recpipe.models.precision import precision_context
from recpipe.planner import plan_from_config
from recpipe.planner.spec import activation_bytes

B = 96  # no layer has 96 units: a saved tensor with 96 rows is per-sample, not a weight
MODEL = dict(embedding_dim=16, num_embeddings_per_feature=[50] * 6, dense_arch_layer_sizes=[32, 16],
             over_arch_layer_sizes=[64, 32, 1])


def _saved_bytes_per_sample(m: ModelConfig, precision: str) -> float:
    """Bytes of the distinct floating-point tensors with B rows that recpipe's model saves
    for backward up to the logits, as it runs them (``RecModel.forward``: the dense arch,
    the sparse arch, the head's interaction and over arch; the loss saves the logit and is
    left out; the sparse arch's lookup saves ids only)."""
    torch.manual_seed(0)
    rec = build_model(m, device=torch.device("cpu"), precision=precision)
    kjt = KeyedJaggedTensor(keys=m.feature_names, values=torch.randint(0, 50, (B * 6,)),
                            lengths=torch.ones(B * 6, dtype=torch.int32))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == B:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with precision_context(rec):
            dense = rec.model.dense_arch(torch.randn(B, m.num_dense_features))
        sparse = sparse_arch_forward(rec.model.sparse_arch, kjt)
        with precision_context(rec):
            rec.model.over_arch(rec.head.interact(dense, sparse))
    return sum(saved.values()) / B


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_bf16_activation_bytes_are_what_autograd_saves(arch):
    m = ModelConfig(arch=arch, **MODEL)
    dense, top = activation_bytes(m, "bf16")
    # every term but the final logit (1 per sample, saved by the loss outside the module)
    assert _saved_bytes_per_sample(m, "bf16") == pytest.approx(dense + top - 2, abs=0.01)


def test_fp32_activation_bytes_are_what_autograd_saves():
    m = ModelConfig(arch="dlrm", **MODEL)
    dense, top = activation_bytes(m, "fp32")
    # the batch's dense features are saved too; the plan counts them in input_batches
    assert _saved_bytes_per_sample(m, "fp32") == pytest.approx(4 * m.num_dense_features + dense + top - 4, abs=0.01)
    dcn = ModelConfig(arch="dcnv2", **MODEL)
    assert sum(activation_bytes(dcn, "fp32")) + 4 * dcn.num_dense_features >= _saved_bytes_per_sample(dcn, "fp32")
    assert activation_bytes(m, "tf32") == (dense, top)  # TF32 changes the matmul, not the tensors


def test_plan_activation_terms_follow_precision():
    overrides = ["data.batch_size=8192", "model.embedding_dim=128", "model.dense_arch_layer_sizes=[512,256,128]",
                 "model.over_arch_layer_sizes=[1024,1024,512,256,1]"]

    def terms(precision: str) -> dict[str, int]:
        plan = plan_from_config(load_config(None, [*overrides, f"train.precision={precision}"]), world_size=1)
        rank = plan.ranks[0]
        phases = dict(rank.phases)
        return {"dense": next(t.bytes for t in rank.terms if t.name == "dense_arch_activations"),
                "forward_end": phases["forward_end"]}

    fp32, bf16 = terms("fp32"), terms("bf16")
    m = load_config(None, [*overrides, "train.precision=bf16"]).model
    assert fp32["dense"] == 8192 * 4 * (512 + 256 + 128)
    assert bf16["dense"] == 8192 * 2 * (13 + 512 + 256 + 128)
    top32, top16 = activation_bytes(m, "fp32")[1], activation_bytes(m, "bf16")[1]
    assert fp32["forward_end"] - bf16["forward_end"] == 8192 * (4 * (512 + 256 + 128) - 2 * (13 + 512 + 256 + 128)
                                                                 + top32 - top16)
