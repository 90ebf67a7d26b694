"""``train.precision``: fp32 is the model as before, bit for bit; bf16 trains under
autocast with fp32 weights, loss and embeddings; tf32 is fp32 on CPU (warning);
recpipe's and TorchRec's pipelines give the same bf16 losses; the generic wrapper
for factory models. GPU tests check TF32 and bf16 on CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline_harness import assert_same, build, make_batches, small_config, train
from recpipe.config import ConfigError, ModelConfig, load_config
from recpipe.data.batch import Batch
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.models import build_model, remove_precision, with_precision
from recpipe.models.precision import PrecisionForward

MODEL = ModelConfig(embedding_dim=8, num_embeddings_per_feature=[30, 20, 10], dense_arch_layer_sizes=[16, 8],
                    over_arch_layer_sizes=[16, 1])


def _batch(seed: int, B: int = 32) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3, (3 * B,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(keys=MODEL.feature_names, values=values, lengths=lengths)
    return Batch(torch.randn(B, MODEL.num_dense_features, generator=g), kjt,
                 torch.randint(0, 2, (B,), generator=g).float(), torch.ones(B))


def _model(precision: str, arch: str = "dlrm"):
    torch.manual_seed(0)
    return build_model(MODEL.model_copy(update={"arch": arch}), device=torch.device("cpu"), precision=precision)


def _train(model: nn.Module, steps: int = 4) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss, _ = model(_batch(i))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _reference_losses(model, steps: int = 4) -> list[torch.Tensor]:
    """RecModel's loss written out without any precision code (the model before it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(steps):
        b = _batch(i)
        opt.zero_grad()
        logits = model.model(b.dense_features, b.sparse_features).squeeze(-1)
        per_sample = nn.functional.binary_cross_entropy_with_logits(logits, b.labels, reduction="none")
        loss = (per_sample * b.weights).sum() / b.labels.numel()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_fp32_trains_bit_identically_to_the_model_without_precision(arch):
    got, want = _train(_model("fp32", arch)), _reference_losses(_model("fp32", arch))
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert torch.get_float32_matmul_precision() == "highest"  # CPU: never touched


def test_tf32_on_cpu_is_fp32_with_a_warning():
    model = _model("tf32")
    with pytest.warns(UserWarning, match="no effect on cpu"):
        got = _train(model)
    assert all(torch.equal(a, b) for a, b in zip(got, _reference_losses(_model("fp32"))))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model, not per step
        model(_batch(0))


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_bf16_trains_under_autocast_with_fp32_weights_loss_and_embeddings(arch):
    model = _model("bf16", arch)
    seen: dict[str, torch.dtype] = {}
    ebc = model.model.sparse_arch.embedding_bag_collection

    def keep_pooled(module, inputs, out):  # the pooled embeddings and their gradient
        seen["pooled"] = out.values().dtype
        out.values().register_hook(lambda g: seen.__setitem__("pooled_grad", g.dtype))

    ebc.register_forward_hook(keep_pooled)
    over = model.model.over_arch
    over.register_forward_hook(lambda m, i, o: seen.__setitem__("logits", o.dtype))
    losses = _train(model, steps=6)
    assert seen == {"pooled": torch.float32, "pooled_grad": torch.float32, "logits": torch.bfloat16}
    assert all(loss.dtype == torch.float32 and torch.isfinite(loss) for loss in losses)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    _, (_, logits, _, _) = model(_batch(0))
    assert logits.dtype == torch.float32  # cast before the loss
    fp32 = _train(_model("fp32", arch), steps=6)
    assert not all(torch.equal(a, b) for a, b in zip(losses, fp32))  # autocast really ran
    assert all(abs(a.item() - b.item()) < 0.05 * abs(b.item()) for a, b in zip(losses, fp32))


def test_precision_is_validated_in_the_config():
    assert load_config(None).train.precision == "fp32"
    assert load_config(None, ["train.precision=bf16"]).train.precision == "bf16"
    with pytest.raises(ConfigError, match=r"train\.precision.*fp16"):
        load_config(None, ["train.precision=fp16"])
    with pytest.raises(ValueError, match="train.precision"):
        build_model(MODEL, precision="fp16")


class _UserModel(nn.Module):
    """A factory-style model: forward(batch) -> (loss, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(MODEL.num_dense_features, 1)

    def forward(self, batch: Batch):
        logits = self.net(batch.dense_features).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def test_with_precision_wraps_a_factory_model_visibly_and_removably():
    torch.manual_seed(0)
    plain = _UserModel()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    loss_fp32, out_fp32 = plain(_batch(0))
    model = with_precision(plain, "bf16")
    assert model is plain and isinstance(vars(model)["forward"], PrecisionForward)
    assert "precision='bf16'" in repr(vars(model)["forward"])
    assert model.state_dict().keys() == before.keys()  # names unchanged
    loss, out = model(_batch(0))
    assert loss.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert not torch.equal(loss, loss_fp32)
    with pytest.raises(ValueError, match="already has an instance forward"):
        with_precision(model, "fp32")
    remove_precision(model)
    assert "forward" not in vars(model)
    assert torch.equal(model(_batch(0))[0], loss_fp32)
    same, out = with_precision(model, "fp32")(_batch(0))
    assert torch.equal(same, loss_fp32) and torch.equal(out, out_fp32)


def _same_numerics_worker(cfg) -> None:
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineBase, TrainPipelineSparseDist

    init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())
    base = train(cfg, "base", batches)
    assert_same(base, train(cfg, "sparse_dist", batches), "bf16 sparse_dist vs base")
    fp32 = train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "fp32"})}), "base", batches)
    assert not all(torch.equal(a, b) for a, b in zip(base.losses, fp32.losses)), "bf16 must differ from fp32"
    for cls in (TrainPipelineBase, TrainPipelineSparseDist):
        sm = build(cfg, torch.device("cpu"))
        pipe = cls(sm.model, sm.optimizer, torch.device("cpu"))
        it, losses = iter(batches), []
        while True:
            try:
                losses.append(pipe.progress(it)[0])
            except StopIteration:
                break
        assert len(losses) == len(base.losses), cls.__name__
        for i, (a, b) in enumerate(zip(losses, base.losses)):
            assert torch.equal(a, b), f"TorchRec {cls.__name__} step {i}: {a.item()!r} vs recpipe {b.item()!r}"


@pytest.mark.slow
def test_recpipe_and_torchrec_pipelines_give_the_same_bf16_losses():
    launch_local(_same_numerics_worker, 2, small_config(overrides=["train.precision=bf16"]))


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_and_bf16_on_cuda():
    device = torch.device("cuda")
    b = _batch(0).to(device)
    seen = []
    for precision in ("tf32", "fp32", "bf16", "tf32"):
        model = build_model(MODEL, device=device, precision=precision).to(device)
        model.model.over_arch.register_forward_hook(
            lambda m, i, o: seen.append((torch.get_float32_matmul_precision(), o.dtype)))
        loss, _ = model(b)
        loss.backward()
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert seen == [("high", torch.float32), ("highest", torch.float32), ("highest", torch.bfloat16),
                    ("high", torch.float32)]
    torch.set_float32_matmul_precision("highest")
