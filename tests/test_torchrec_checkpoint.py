"""Checkpoints move between TorchRec and recpipe: ``recpipe checkpoint convert``.

TorchRec's side is TorchRec's own ``DistributedModelParallel`` of ``DLRMTrain`` with its fused
embedding optimizer and a ``KeyedOptimizerWrapper`` over the dense parameters, saved and loaded
with ``torch.distributed.checkpoint`` as TorchRec users do; recpipe's side is its sharded model
and ``save_checkpoint`` / ``load_chosen``. One gloo rank on CPU, the two sides sharded differently;
``recpipe train`` resumes a one-rank TorchRec checkpoint on two ranks.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline_harness import build
from recpipe.checkpoint.integrity import verify_checkpoint
from recpipe.checkpoint.reader import read_metadata
from recpipe.checkpoint.store import TrainPosition, check_resume, choose_checkpoint, load_chosen, save_checkpoint
from recpipe.cli import main
from recpipe.config import load_config
from recpipe.errors import CheckpointError
from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_CHECKPOINT
from recpipe.models.dlrm import embedding_configs
from recpipe.table_sharding.sharders import embedding_fused_params
from test_checkpoint import Payload

CFG = load_config(None, [
    "model.num_embeddings_per_feature=[40, 60, 30]",
    "model.embedding_dim=4",
    "model.num_dense_features=5",
    "model.dense_arch_layer_sizes=[8, 4]",
    "model.over_arch_layer_sizes=[8, 1]",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}",
    "optimizer.embedding.lr=0.1",
    "optimizer.dense.name=adagrad",
    "optimizer.dense.lr=0.1",
    "train.device=cpu",
    "distributed.backend=gloo",
    "distributed.nproc=1",
])
CPU = torch.device("cpu")
STEPS = 3  # trained before each save: every optimizer state is past its initial value


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def torchrec_dmp(seed: int) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """TorchRec's DMP of DLRMTrain over CFG's tables, sharded its own way (t_cat_0 row-wise,
    the others table-wise), with the fused optimizer recpipe's config makes and Adagrad over
    the dense parameters."""
    torch.manual_seed(seed)
    m = CFG.model
    ebc = EmbeddingBagCollection(tables=embedding_configs(m), device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=m.num_dense_features,
                           dense_arch_layer_sizes=list(m.dense_arch_layer_sizes),
                           over_arch_layer_sizes=list(m.over_arch_layer_sizes)))
    fused = embedding_fused_params(CFG.optimizer.embedding, CFG.sharding.uvm_host_mapped)
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    per_table = {"t_cat_0": row_wise(compute_kernel="fused"),
                 **{t: table_wise(rank=0, compute_kernel="fused") for t in ("t_cat_1", "t_cat_2")}}
    plan = construct_module_sharding_plan(model.model.sparse_arch.embedding_bag_collection, per_table,
                                          sharder=sharder, local_size=1, world_size=1, device_type="cpu")
    dmp = DistributedModelParallel(model, device=CPU, sharders=[sharder],
                                   plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}))
    adagrad = lambda p: torch.optim.Adagrad(p, lr=CFG.optimizer.dense.lr, eps=CFG.optimizer.dense.eps)  # noqa: E731
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), adagrad)
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def recpipe_model(seed: int):
    torch.manual_seed(seed)
    sm = build(CFG, CPU)
    return sm.model, sm.optimizer


def batch(i: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    rows, B = CFG.model.num_embeddings_per_feature, 8
    keys = [c.feature_names[0] for c in embedding_configs(CFG.model)]
    lengths = torch.randint(0, 3, (len(keys) * B,), generator=g)
    values = torch.cat([torch.randint(0, rows[k], (int(lengths[k * B:(k + 1) * B].sum()),), generator=g)
                        for k in range(len(keys))])
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    return torch.rand(B, CFG.model.num_dense_features, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float()


def step(dmp: DistributedModelParallel, optimizer: CombinedOptimizer, i: int) -> None:
    """One training step of the DLRM inside either side's DMP (DLRMTrain.model, RecModel.model)
    on batch ``i``: the same computation on both sides, so equal states give equal weights."""
    dense, kjt, labels = batch(i)
    logits = dmp.module.model(dense, kjt).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    optimizer.step()
    optimizer.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (one rank holds every shard)."""
    if isinstance(t, ShardedTensor):
        out = torch.zeros(t.size(), dtype=t.dtype)
        for shard in t.local_shards():
            out[tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))] = \
                shard.tensor
        return out
    return t.detach().clone()


def weights(dmp: DistributedModelParallel) -> dict[str, torch.Tensor]:
    return {key: full(value) for key, value in dmp.state_dict().items()}


def optimizer_states(optimizer: CombinedOptimizer) -> dict[str, torch.Tensor]:
    return {f"{param}.{name}": full(value) for param, state in optimizer.state_dict()["state"].items()
            for name, value in state.items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, different


def assert_continues(loaded: tuple, saved: tuple) -> None:
    """``loaded`` (model, optimizer) holds the weights and every optimizer state of ``saved``, and
    one more step on each gives the same weights."""
    assert_equal(weights(loaded[0]), weights(saved[0]))
    states = optimizer_states(loaded[1])
    assert sum(key.endswith("momentum1") for key in states) == 3 and any(key.endswith(".sum") for key in states)
    assert_equal(states, optimizer_states(saved[1]))
    step(*loaded, STEPS)
    step(*saved, STEPS)
    assert_equal(weights(loaded[0]), weights(saved[0]))


def trained(dmp: DistributedModelParallel, optimizer: CombinedOptimizer) -> tuple:
    for i in range(STEPS):
        step(dmp, optimizer, i)
    return dmp, optimizer


def torchrec_save(dmp, optimizer, path: Path) -> None:
    dcp.save({"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(path))


def torchrec_load(dmp, optimizer, path: Path) -> None:
    """As TorchRec users load: in place into the live state_dicts, then handed back."""
    state = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    dmp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def test_a_torchrec_checkpoint_resumes_in_recpipe(tmp_path, one_rank, capsys):
    dmp, optimizer = torchrec_dmp(seed=1)
    optimizer.save_param_groups(True)  # saved too: recpipe takes its hyperparameters from its config
    trained(dmp, optimizer)
    torchrec_save(dmp, optimizer, tmp_path / "torchrec")
    saved = read_metadata(tmp_path / "torchrec").state_dict_metadata
    assert any(key.startswith("optimizer.state.") for key in saved)
    assert any(key.startswith("optimizer.param_groups.") for key in saved)

    ckpt = tmp_path / "ckpt"
    assert main(["checkpoint", "convert", "--from", "torchrec", str(tmp_path / "torchrec"), str(ckpt),
                 "--step", str(STEPS)]) == 0
    converted = ckpt / f"step_{STEPS:08d}"
    assert f"{converted}: TorchRec's checkpoint" in capsys.readouterr().out
    assert verify_checkpoint(converted) == []  # recpipe's record: every file's size and CRC-32
    assert main(["checkpoint", "verify", str(ckpt)]) == 0

    cfg = CFG.model_copy(update={"checkpoint": CFG.checkpoint.model_copy(update={"dir": str(ckpt)}),
                                 "distributed": CFG.distributed.model_copy(update={"nproc": 4})})
    check_resume(cfg)  # a converted checkpoint has no number of ranks of its own
    model, recpipe_optimizer = recpipe_model(seed=2)
    chosen = choose_checkpoint(cfg.checkpoint)
    assert chosen.path == converted and chosen.position == TrainPosition(step=STEPS, epoch=0, batch=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_chosen(chosen, model, recpipe_optimizer)
    assert not [w for w in caught if "RNG" in str(w.message)]  # it has none to restore, and needs none

    assert_continues((model, recpipe_optimizer), (dmp, optimizer))


def test_a_recpipe_checkpoint_resumes_in_torchrec(tmp_path, one_rank, capsys):
    model, optimizer = trained(*recpipe_model(seed=1))
    cfg = CFG.checkpoint.model_copy(update={"dir": str(tmp_path / "ckpt")})
    saved = save_checkpoint(cfg, model, optimizer, TrainPosition(step=STEPS, epoch=0, batch=STEPS))

    out = tmp_path / "torchrec"
    assert main(["checkpoint", "convert", "--to", "torchrec", str(tmp_path / "ckpt"), str(out)]) == 0
    assert f"{out}: recpipe's checkpoint {saved} as TorchRec's" in capsys.readouterr().out
    dmp, torchrec_optimizer = torchrec_dmp(seed=2)
    torchrec_load(dmp, torchrec_optimizer, out)

    assert_continues((dmp, torchrec_optimizer), (model, optimizer))


def test_converting_refuses_what_it_cannot_read_before_writing(tmp_path, one_rank, capsys):
    dmp, optimizer = torchrec_dmp(seed=1)
    src = tmp_path / "torchrec"
    torchrec_save(dmp, optimizer, src)
    ckpt = tmp_path / "ckpt"

    def convert(*args: str) -> int:
        return main(["checkpoint", "convert", *args])

    # a data file shorter than its metadata says
    data = sorted(src.glob("*.distcp"))[0]
    whole = data.read_bytes()
    data.write_bytes(whole[:-10])
    assert convert("--from", "torchrec", str(src), str(ckpt)) == EXIT_CHECKPOINT
    assert f"{data.name} has {len(whole) - 10} bytes, its metadata needs" in capsys.readouterr().err
    assert not ckpt.exists()
    data.write_bytes(whole)

    # a .metadata that names code to run: refused, and the code never runs
    crafted = tmp_path / "crafted"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(crafted))
    metadata = pickle.loads((crafted / ".metadata").read_bytes())  # this test's own file
    metadata.planner_data = Payload(tmp_path / "ran")
    (crafted / ".metadata").write_bytes(pickle.dumps(metadata))
    assert convert("--from", "torchrec", str(crafted), str(ckpt)) == EXIT_CHECKPOINT
    assert "it names posix.system, which no checkpoint holds" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists() and not ckpt.exists()

    # a DST that cannot be written: one line naming it, no traceback
    (tmp_path / "file").write_text("")
    assert convert("--from", "torchrec", str(src), str(tmp_path / "file" / "ckpt")) == EXIT_CHECKPOINT
    assert f"({tmp_path / 'file' / 'ckpt' / 'step_00000000'}: Not a directory) [exit 6]" in capsys.readouterr().err

    # a recpipe checkpoint is not TorchRec's
    assert convert("--from", "torchrec", str(src), str(ckpt), "--step", "2") == 0
    assert convert("--from", "torchrec", str(ckpt / "step_00000002"), str(tmp_path / "again")) == EXIT_CHECKPOINT
    assert "is not a KeyedOptimizer's state_dict" in capsys.readouterr().err
    # a checkpoint.dir that holds checkpoints already
    assert convert("--from", "torchrec", str(src), str(ckpt)) == EXIT_CHECKPOINT
    assert "already holds checkpoints" in capsys.readouterr().err
    assert convert("--from", "torchrec", str(src), str(tmp_path / "c2"), "--step", "-1") == EXIT_BAD_CONFIG
    assert convert("--to", "torchrec", str(ckpt), str(tmp_path / "c2"), "--step", "1") == EXIT_BAD_CONFIG
    assert "--step goes with --from torchrec" in capsys.readouterr().err

    # --to torchrec verifies the recpipe checkpoint first, and never writes into a directory in use
    converted = ckpt / "step_00000002"
    assert convert("--to", "torchrec", str(ckpt), str(src)) == EXIT_CHECKPOINT
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    data = sorted(converted.glob("*.distcp"))[0]
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 1
    data.write_bytes(damaged)
    assert convert("--to", "torchrec", str(ckpt), str(tmp_path / "out")) == EXIT_CHECKPOINT
    assert f"checkpoint {converted} is damaged: {data.name} differs from what was saved" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_of_the_fused_optimizer_alone_resumes_without_dense_state(tmp_path, one_rank):
    dmp, optimizer = trained(*torchrec_dmp(seed=1))
    dcp.save({"model": dmp.state_dict(), "optimizer": dmp.fused_optimizer.state_dict()},
             checkpoint_id=str(tmp_path / "torchrec"))
    assert main(["checkpoint", "convert", "--from", "torchrec", str(tmp_path / "torchrec"),
                 str(tmp_path / "ckpt")]) == 0
    chosen = choose_checkpoint(CFG.checkpoint.model_copy(update={"dir": str(tmp_path / "ckpt")}))

    model, adagrad = recpipe_model(seed=2)  # a dense optimizer whose state the checkpoint lacks
    with pytest.raises(CheckpointError, match=r"Missing key in checkpoint state_dict: optimizer\.model\.dense_arch"):
        load_chosen(chosen, model, adagrad)
    sgd = CFG.model_copy(update={"optimizer": CFG.optimizer.model_copy(update={
        "dense": CFG.optimizer.dense.model_copy(update={"name": "sgd"})})})
    torch.manual_seed(2)
    sm = build(sgd, CPU)
    load_chosen(chosen, sm.model, sm.optimizer)
    assert_equal(weights(sm.model), weights(dmp))
    assert_equal(optimizer_states(sm.optimizer), optimizer_states(dmp.fused_optimizer))


TRAIN = ["model.num_embeddings_per_feature=[40, 60, 30]", "model.embedding_dim=4", "model.num_dense_features=5",
         "model.dense_arch_layer_sizes=[8, 4]", "model.over_arch_layer_sizes=[8, 1]", "sharding.tables={}",
         "optimizer.dense.name=adagrad", "train.device=cpu", "distributed.backend=gloo", "distributed.nproc=2",
         "train.eval_every=0", "train.progress=false", "data.batch_size=16", "data.synthetic.num_batches=4",
         "data.synthetic.num_eval_batches=1"]


@pytest.mark.slow
def test_recpipe_train_resumes_a_converted_torchrec_checkpoint_on_two_ranks(tmp_path, capfd):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torchrec_save(*trained(*torchrec_dmp(seed=1)), tmp_path / "torchrec")
    finally:
        dist.destroy_process_group()
    ckpt = tmp_path / "ckpt"
    assert main(["checkpoint", "convert", "--from", "torchrec", str(tmp_path / "torchrec"), str(ckpt),
                 "--step", str(STEPS)]) == 0

    def train(*overrides: str) -> int:
        settings = [*TRAIN, f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path / 'run'}", *overrides]
        return main(["train", "--config", "quickstart", *[a for s in settings for a in ("--set", s)]])

    assert train("model.num_embeddings_per_feature=[40, 61, 30]", f"train.steps={STEPS + 2}") == EXIT_BAD_CONFIG
    assert "t_cat_1.weight: [60, 4] saved, [61, 4] in the config's model" in capfd.readouterr().err
    assert train(f"train.steps={STEPS + 2}") == 0
    assert f"resumed from {ckpt / f'step_{STEPS:08d}'}: step {STEPS}, epoch 0, batch 0" in capfd.readouterr().out
    assert (ckpt / f"step_{STEPS + 2:08d}" / "metadata.json").is_file()
