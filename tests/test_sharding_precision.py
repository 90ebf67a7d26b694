"""fp16 tables and quantized comms on CPU (2 Gloo processes): every module type
trains fp16 tables and computes what the unsharded model computes with the same
(fp16-rounded) weights; fp16 comms change the numbers slightly and really run;
every pipeline stays exact with both; checkpoints save and resume fp16 tables
bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import SparseType
from torch import nn

import sharding_models
from pipeline_harness import assert_same, make_batches, semi_sync_reference, small_config, train
from recpipe.cli import main
from recpipe.config import load_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.embedding_tables import find_embedding_modules
from recpipe.sharding import shard_model
from test_checkpoint import TINY, K, M, _full_state
from test_sharding import SPARSE_NN, TWO_TOWER, _cfg, _copy_weights

FP16 = "{weights_precision: fp16}"


def _reference(cfg, build) -> nn.Module:
    """The unsharded model on CPU (:func:`sharding_models.reference_model`), embedding
    weights rounded to fp16 (what an fp16 table holds), computing in fp32."""
    reference = sharding_models.reference_model(build, cfg, "cpu")
    with torch.no_grad():
        for module in find_embedding_modules(reference).values():
            for name, p in module.named_parameters():
                if name.endswith(".weight") and p.dim() == 2:
                    p.copy_(p.half().float())
    return reference


@pytest.mark.parametrize("model", [SPARSE_NN, TWO_TOWER], ids=["TestSparseNN", "two_tower_with_EC"])
def test_the_reference_starts_from_the_models_buffers_not_empty_memory(model, monkeypatch):
    """The unsharded reference the sharded models copy their weights from: with the
    memory ``to_empty`` hands out poisoned (NaN floats), every parameter is initialized
    and every buffer is the model's own (TestSparseNN's ``dummy_ones`` is 1, and its
    loss is finite): nothing of the reference is read uninitialized."""
    empty_like = torch.empty_like

    def poisoned(t, *args, **kwargs):
        out = empty_like(t, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-7)

    monkeypatch.setattr(torch, "empty_like", poisoned)
    cfg = _fp16(model)
    build = getattr(sharding_models, model[0])
    reference = _reference(cfg, build)
    own = dict(build(cfg).named_buffers())
    assert all(torch.isfinite(p).all() for p in reference.parameters())
    for name, b in reference.named_buffers():
        assert torch.equal(b, own[name]), name
    if model is SPARSE_NN:
        assert reference.dummy_ones.item() == 1.0
    batch = getattr(sharding_models, f"{model[0]}_batches")(cfg, 1, 2, 1)[0]
    assert torch.isfinite(reference(batch)[0])


def _fp16_worker(cfg, factory: str, make_batches_fn: str) -> None:
    init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    build = getattr(sharding_models, factory)
    reference = _reference(cfg, build)
    batch = getattr(sharding_models, make_batches_fn)(cfg, rank, world, 1)[0]
    expected, _ = reference(batch)
    losses, outputs = {}, {}
    for comm in ("fp32", "fp16"):
        c = load_config(None, {**cfg.model_dump(mode="json"), "sharding": {
            **cfg.sharding.model_dump(mode="json"), "comm_precision": {"forward": comm, "backward": comm}}})
        sharded = shard_model(build(c), c, torch.device("cpu"))
        _copy_weights(sharded.model, reference)
        for key, value in sharded.model.state_dict().items():  # every sharded table holds fp16 weights
            if hasattr(value, "local_shards") and value.local_shards():
                assert value.local_shards()[0].tensor.dtype == torch.float16, key
        losses[comm], _ = sharded.model(batch)
        losses[comm].backward()
        # the dense gradients see every embedding value (and the backward all-to-all's
        # gradients): a more sensitive probe than a saturating output
        outputs[comm] = torch.cat([p.grad.flatten() for p in sharded.model.parameters() if p.grad is not None])
        sharded.optimizer.step()
        assert torch.isfinite(sharded.model(batch)[0])
    torch.testing.assert_close(losses["fp32"], expected, rtol=1e-6, atol=1e-7)  # fp16 weights, fp32 math
    # fp16 on the wire: close to fp32, but not the same numbers (the codec runs)
    torch.testing.assert_close(losses["fp16"], expected, rtol=2e-3, atol=1e-4)
    differs = torch.tensor([int(not torch.equal(outputs["fp16"], outputs["fp32"]))])
    dist.all_reduce(differs)
    assert differs.item() > 0, "fp16 comms gave bit-identical gradients: the codec did not run"


def _fp16(model):
    name, tables, options = model
    cfg = _cfg(name, tables, options)
    default = {"type": "table_wise", "weights_precision": "fp16"}
    resolved = {k: {**v.model_dump(mode="json"), "weights_precision": "fp16" if v.type != "data_parallel" else None}
                for k, v in cfg.sharding.tables.items()}
    return load_config(None, {**cfg.model_dump(mode="json"), "sharding": {
        **cfg.sharding.model_dump(mode="json"), "default": default, "tables": resolved}})


@pytest.mark.slow
@pytest.mark.parametrize("model", [SPARSE_NN, TWO_TOWER], ids=["TestSparseNN", "two_tower_with_EC"])
def test_fp16_tables_and_fp16_comms_on_every_module(model):
    launch_local(_fp16_worker, 2, _fp16(model), model[0], f"{model[0]}_batches")


# ------------------------------------------------------------------ pipelines
PRECISE = ["sharding.default=" + FP16,
           f"sharding.tables={{t_cat_1: {{type: row_wise, weights_precision: fp16}}, "
           f"t_cat_2: {{type: column_wise, weights_precision: fp16}}}}",
           "sharding.comm_precision={forward: fp16, backward: fp16}"]


def _pipelines_worker(cfg) -> None:
    init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())
    reference = train(cfg, "base", batches)
    assert all(v.dtype == torch.float16 for k, v in reference.state.items() if "embedding_bags" in k)
    for name in ("sparse_dist", "fused_sparse_dist", "prefetch"):
        assert_same(reference, train(cfg, name, batches), f"{name} with fp16 tables and comms")
    assert_same(semi_sync_reference(cfg, batches, 0, False), train(cfg, "semi_sync", batches), "semi_sync")


@pytest.mark.slow
def test_every_pipeline_stays_exact_with_fp16_tables_and_comms():
    launch_local(_pipelines_worker, 2, small_config(overrides=PRECISE))


# ------------------------------------------------------------------ TBEs that write the wire precision
def _tbes(model: nn.Module) -> list:
    """The FBGEMM TBEs of every sharded module (torchrec keeps its lookups in a list, a
    data_parallel one inside DDP)."""
    from recpipe.runtime.sharded import find_sharded_modules

    return [e._emb_module for m in find_sharded_modules(model).values() for lookup in m._lookups
            for e in getattr(getattr(lookup, "module", lookup), "_emb_modules", [])]


def _tbe_output_worker(cfg) -> None:
    """The same half precision both ways on two ranks (fp16 on CPU, bf16 on CUDA): the
    TBEs write it (FBGEMM output_dtype) and only cast codecs run
    (recpipe.table_sharding.comm.tbe_output_precision). On CPU the first forward equals
    torchrec's own codecs on fp32 TBE outputs (both round the same fp32 sums once); the
    TBE backward then takes the half-precision gradient itself instead of its exact fp32
    copy, and FBGEMM's kernel sums it in another order: later steps agree to rounding,
    far closer than half-precision comms are to fp32 ones. base and sparse_dist stay
    identical to each other."""
    from pipeline_harness import build

    from recpipe.table_sharding import comm
    from recpipe.config import CommPrecision

    device = init_process_group(cfg)
    wire = SparseType(comm.tbe_output_precision(cfg.sharding, 2, device.type))
    # Ids 0-11: each row-wise table's ids all on rank 0 (its other rank adds zeros). The
    # spread batches, where both ranks add partial sums, are checked step by step below.
    batches = make_batches(cfg, 6, dist.get_rank(), spread=False)
    tbes = _tbes(build(cfg, device).model)
    assert tbes and all(t.output_dtype == wire.as_int() for t in tbes), [t.output_dtype for t in tbes]
    ours = {name: train(cfg, name, batches, device=device) for name in ("base", "sparse_dist")}
    real = comm.tbe_output_precision
    comm.tbe_output_precision = lambda sharding, world_size, device_type="cuda": None
    try:
        tbes = _tbes(build(cfg, device).model)
        assert tbes and all(t.output_dtype == SparseType.FP32.as_int() for t in tbes)
        codecs = train(cfg, "base", batches, device=device)
        if device.type == "cpu":
            assert codecs.losses[0] == ours["base"].losses[0], (codecs.losses[0], ours["base"].losses[0])
        fp32 = cfg.model_copy(update={"sharding": cfg.sharding.model_copy(update={"comm_precision": CommPrecision()})})
        mine, theirs = torch.stack(ours["base"].losses), torch.stack(codecs.losses)
        gap = (mine - torch.stack(train(fp32, "base", batches, device=device).losses)).abs().max()
        assert (mine - theirs).abs().max() < 0.1 * gap, ((mine - theirs).abs().max(), gap)
    finally:
        comm.tbe_output_precision = real
    assert_same(ours["base"], ours["sparse_dist"], "sparse_dist vs base with half-precision TBE outputs")
    if device.type == "cpu":  # on CUDA the TBE's bf16 rounding of its output need not be the codec's
        _one_step_as_codecs(cfg, device)
    # one rank: torchrec's all-to-alls return the TBE output without decoding: it stays fp32;
    # so with a data_parallel table, whose lookup output reaches the model without one
    assert comm.tbe_output_precision(cfg.sharding, 1, device.type) is None
    half = cfg.sharding.comm_precision.forward
    with_dp = small_config(2, [f"train.device={device.type}", f"sharding.comm_precision={{forward: {half}, backward: {half}}}"])
    assert comm.tbe_output_precision(with_dp.sharding, 2, device.type) is None
    tbes = _tbes(build(with_dp, device).model)  # small_config's tables include a data_parallel one
    assert any("Dense" in type(t).__name__ for t in tbes), tbes
    assert all(t.output_dtype == SparseType.FP32.as_int() for t in tbes), [t.output_dtype for t in tbes]


def _one_step_as_codecs(cfg, device) -> None:
    """Batches whose row-wise ids fall on both ranks (both add partial sums): one step of
    the TBE-output path against torchrec's codecs. The forward is the same (both round
    the fp32 partial sums to the wire precision once), so the loss and every dense
    parameter after the step are equal; only the TBE's own update differs, as it takes
    the half-precision gradient itself instead of its fp32 copy. Measured on CPU (FBGEMM
    1.8's fp16-gradient kernel): 1 to 5 fp16 units in the last place apart per table after
    this one step (table-wise and row-wise alike), and over 6 steps the two paths' losses
    as far apart as half- and fp32 comms are (rank 1: 2.1e-5 and 1.3e-5), not the 10x
    closer that ids 0-11 give above."""
    from recpipe.table_sharding import comm

    batches = make_batches(cfg, 1, dist.get_rank())
    ours = train(cfg, "base", batches, device=device)
    real = comm.tbe_output_precision
    comm.tbe_output_precision = lambda sharding, world_size, device_type="cuda": None
    try:
        codecs = train(cfg, "base", batches, device=device)
    finally:
        comm.tbe_output_precision = real
    assert torch.equal(ours.losses[0], codecs.losses[0]), (ours.losses[0], codecs.losses[0])
    tables = [key for key in ours.state if "embedding_bags" in key]
    assert tables and all(ours.state[k].dtype == torch.float16 for k in tables), tables
    for key, mine in ours.state.items():
        if key not in tables:
            assert torch.equal(mine, codecs.state[key]), f"{key} differs after one step"
    ulps = {k.split(".")[-2]: int((ours.state[k].view(torch.int16).int() - codecs.state[k].view(torch.int16).int())
                                  .abs().max()) for k in tables}
    print(f"rank {dist.get_rank()}: fp16 table units in the last place apart after one step: {ulps}")


def test_tbes_write_the_wire_precision_and_train_as_torchrecs_codecs():
    launch_local(_tbe_output_worker, 2, small_config(overrides=PRECISE))


# ------------------------------------------------------------------ checkpoints
def _train(config: Path, run: Path, steps: int, every: int) -> int:
    args = ["train", "--config", str(config)]
    for pair in TINY + [f"train.steps={steps}", f"checkpoint.dir={run / 'ckpt'}", f"checkpoint.every={every}",
                        "checkpoint.keep=1", f"logging.run_dir={run}", "sharding.default=" + FP16,
                        "sharding.tables={t_cat_1: {type: row_wise, weights_precision: fp16}, "
                        "t_cat_2: {type: column_wise, weights_precision: fp32}}"]:
        args += ["--set", pair]
    return main(args)


@pytest.mark.slow
def test_fp16_tables_resume_bit_identically(tmp_path):
    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _train(config, straight, steps=K + M, every=0) == 0
    assert _train(config, resumed, steps=K, every=K) == 0
    assert _train(config, resumed, steps=K + M, every=K) == 0
    a = _full_state(straight / "ckpt" / f"step_{K + M:08d}", tmp_path)
    b = _full_state(resumed / "ckpt" / f"step_{K + M:08d}", tmp_path)
    tables = {k: v.dtype for k, v in a.items() if k.startswith("model.") and "embedding_bags" in k}
    assert sorted(tables.values(), key=str) == [torch.float16] * 3 + [torch.float32]  # t_cat_2 stays fp32
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"
