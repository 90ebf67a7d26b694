"""Checkpoints are exact: stopping after k steps and resuming trains bit for bit
like a run that never stopped (model, fused embedding optimizer and dense optimizer
states), and incomplete checkpoints are ignored. Damaged ones (a truncated shard)
are found before loading, named and skipped; a save into a read-only directory
fails with one error naming the path and leaves the previous checkpoint newest."""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from recpipe.checkpoint import store
from recpipe.checkpoint.integrity import MARKER_FILE, file_records, verify_checkpoint
from recpipe.checkpoint.reader import UnsafeCheckpointError, dcp_load, read_metadata
from recpipe.checkpoint.store import (METADATA_FILE, check_resume, check_resume_shapes, choose_checkpoint,
                                      latest_checkpoint, load_checkpoint, resume_settings)
from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.errors import CheckpointError
from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_CHECKPOINT

K, M = 6, 5  # resume after K steps, then train M more
TINY = [
    "model.num_embeddings_per_feature=[100, 300, 500, 1000]",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16, 8]",
    "model.over_arch_layer_sizes=[16, 1]",
    "data.batch_size=64",
    # 4 batches per epoch: step K lies inside epoch 1, so the data position matters.
    "data.synthetic.num_batches=4",
    "data.synthetic.num_eval_batches=1",
    "train.epochs=3",
    "train.eval_every=0",
    "train.progress=false",
    "sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}",
    # Adam's state is created lazily at the first step: a fresh optimizer has none.
    "optimizer.dense.name=adam",
    "distributed.nproc=2",
    "distributed.backend=gloo",
    "train.device=cpu",
]


def _args(config: Path, run: Path, steps: int, every: int, keep: int = 1) -> list[str]:
    overrides = TINY + [
        f"train.steps={steps}",
        f"checkpoint.dir={run / 'ckpt'}",
        f"checkpoint.every={every}",
        f"checkpoint.keep={keep}",
        f"logging.run_dir={run}",
    ]
    args = ["train", "--config", str(config)]
    for pair in overrides:
        args += ["--set", pair]
    return args


def _train(config: Path, run: Path, steps: int, every: int, keep: int = 1) -> int:
    return main(_args(config, run, steps, every, keep))


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _full_state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, shards reassembled (no process group needed)."""
    target = tmp_path / f"{checkpoint.parent.parent.name}.pt"
    dcp_to_torch_save(checkpoint, target)
    return _flat(torch.load(target, weights_only=False))


@pytest.mark.slow
def test_resume_trains_bit_identically(tmp_path, capfd):
    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _train(config, straight, steps=K + M, every=0) == 0
    assert _train(config, resumed, steps=K, every=K) == 0  # "interrupted" after step K
    meta = json.loads((resumed / "ckpt" / f"step_{K:08d}" / METADATA_FILE).read_text())
    assert (meta["step"], meta["epoch"], meta["batch"]) == (K, 1, 2)
    assert _train(config, resumed, steps=K + M, every=K) == 0
    assert f"resumed from {resumed / 'ckpt' / f'step_{K:08d}'}: step {K}, epoch 1, batch 2" in capfd.readouterr().out
    assert [p.name for p in (resumed / "ckpt").glob("step_*")] == [f"step_{K + M:08d}"]  # checkpoint.keep=1

    a = _full_state(straight / "ckpt" / f"step_{K + M:08d}", tmp_path)
    b = _full_state(resumed / "ckpt" / f"step_{K + M:08d}", tmp_path)
    assert a.keys() == b.keys()
    # The comparison covers the sharded tables, the fused row-wise Adagrad momentum
    # and Adam's moments of the dense weights.
    assert sum(k.startswith("model.") and "embedding_bags" in k for k in a) == 4
    assert sum(k.endswith("momentum1") for k in a) == 4
    assert any(k.endswith("exp_avg_sq") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"


def test_incomplete_checkpoint_is_ignored_with_a_warning(tmp_path):
    complete, partial = tmp_path / "step_00000003", tmp_path / "step_00000005"
    complete.mkdir()
    (complete / METADATA_FILE).write_text("{}")
    partial.mkdir()  # an interrupted save: the marker a save writes first, no metadata.json
    (partial / MARKER_FILE).write_text("")
    (partial / "__0_0.distcp").write_bytes(b"half-written")
    for name in ("step_00000007", "step_foo"):  # named like checkpoints, but no save of recpipe's began them
        (tmp_path / name).mkdir()
    with pytest.warns(UserWarning, match="ignoring incomplete checkpoint .*step_00000005") as warned:
        assert latest_checkpoint(tmp_path) == complete
    assert len(warned) == 1, [str(w.message) for w in warned]
    (complete / METADATA_FILE).unlink()
    with pytest.warns(UserWarning):
        assert latest_checkpoint(tmp_path) is None


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    old = tmp_path / "ckpt" / "step_00000010"
    old.mkdir(parents=True)
    (old / METADATA_FILE).write_text("{}")
    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    code = main(["train", "--config", str(config), "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.resume=false"])
    assert code == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "checkpoint.resume=false" in err and "step_00000010" in err


CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"


@pytest.mark.slow
def test_damaged_checkpoint_is_named_and_skipped(tmp_path, capfd):
    run = tmp_path / "run"
    assert _train(CONFIG, run, steps=4, every=2, keep=2) == 0
    newest = run / "ckpt" / "step_00000004"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    capfd.readouterr()
    assert main(["checkpoint", "verify", str(run / "ckpt")]) == EXIT_CHECKPOINT
    out = capfd.readouterr().out
    assert f"{newest}: DAMAGED: {shard.name} has {size // 2} bytes, {size} were saved" in out
    assert f"{run / 'ckpt' / 'step_00000002'}: ok" in out

    assert _train(CONFIG, run, steps=6, every=2, keep=2) == 0
    captured = capfd.readouterr()
    assert f"skipping damaged checkpoint {newest}: {shard.name} has {size // 2} bytes" in captured.err
    assert f"resumed from {run / 'ckpt' / 'step_00000002'}: step 2" in captured.out
    assert main(["checkpoint", "verify", str(run / "ckpt")]) == 0  # step 4 saved anew, step 6
    assert "DAMAGED" not in capfd.readouterr().out


def _damage(ckpt: Path, how: str) -> Path:
    """Damage the largest shard of ``ckpt``: truncated, or one byte changed (same size)."""
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    return shard


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "changed"])
def test_pruning_never_deletes_the_newest_intact_checkpoint_to_keep_a_damaged_one(tmp_path, capfd, how):
    """step 2 intact, step 4 damaged: the resumed run saves step 5 and keeps (keep=2) the
    two intact ones, 2 and 5; the damaged one and an interrupted save go."""
    run = tmp_path / "run"
    assert _train(CONFIG, run, steps=4, every=2, keep=2) == 0
    _damage(run / "ckpt" / "step_00000004", how)
    interrupted = run / "ckpt" / "step_00000003"
    interrupted.mkdir()  # a save that never finished: the marker a save writes first, no metadata.json
    (interrupted / MARKER_FILE).write_text("")
    (interrupted / "__0_0.distcp").write_bytes(b"partial")
    assert _train(CONFIG, run, steps=5, every=0, keep=2) == 0
    assert f"resumed from {run / 'ckpt' / 'step_00000002'}" in capfd.readouterr().out
    assert sorted(p.name for p in (run / "ckpt").glob("step_*")) == ["step_00000002", "step_00000005"]
    assert main(["checkpoint", "verify", str(run / "ckpt")]) == 0


def test_verify_finds_every_kind_of_damage(tmp_path):
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    for name, data in {"__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 50, ".metadata": b"m", "rng_rank00000.pt": b"r"}.items():
        (ckpt / name).write_bytes(data)
    records = {**file_records(ckpt, 0, 2), **file_records(ckpt, 1, 2)}
    assert set(records) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng_rank00000.pt"}
    (ckpt / METADATA_FILE).write_text(json.dumps({"step": 1, "files": records}))
    assert verify_checkpoint(ckpt) == []
    (ckpt / "__0_0.distcp").write_bytes(b"a" * 99 + b"X")  # same size, one byte changed
    (ckpt / "__1_0.distcp").write_bytes(b"b" * 49)
    (ckpt / ".metadata").unlink()
    problems = verify_checkpoint(ckpt)
    assert [p.split()[0] for p in problems] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "missing" in problems[0] and "crc32" in problems[1] and "49 bytes, 50 were saved" in problems[2]
    # Rank 1 of 2 reads only its own file's contents (sizes it checks for all).
    assert [p.split()[0] for p in verify_checkpoint(ckpt, rank=1, world_size=2)] == [".metadata", "__1_0.distcp"]
    (ckpt / METADATA_FILE).write_text(json.dumps({"step": 1}))  # format 1: nothing recorded
    assert verify_checkpoint(ckpt) is None
    (ckpt / METADATA_FILE).write_text("{not json")
    assert "cannot be read" in verify_checkpoint(ckpt)[0]


def test_no_intact_checkpoint_is_an_error_naming_each(tmp_path):
    for step in (2, 4):
        ckpt = tmp_path / f"step_{step:08d}"
        ckpt.mkdir()
        (ckpt / "__0_0.distcp").write_bytes(b"x")
        (ckpt / METADATA_FILE).write_text(json.dumps({"step": step, "files": {"__0_0.distcp": {"size": 2, "crc32": "0"}}}))
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match="skipping damaged checkpoint .*step_00000004"):
            with pytest.raises(CheckpointError, match="no intact checkpoint .*step_00000004: __0_0.distcp has 1 bytes.*step_00000002"):
                load_checkpoint(cfg.checkpoint, model=None, optimizer=None)
    finally:
        dist.destroy_process_group()


def _without_root_override() -> list[str]:
    """A command prefix under which directory permissions hold: root bypasses them
    (CAP_DAC_OVERRIDE), so as root drop those capabilities with util-linux setpriv."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: root ignores directory permissions")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


@pytest.mark.slow
def test_save_into_a_read_only_directory_fails_naming_it(tmp_path):
    run = tmp_path / "run"
    assert _train(CONFIG, run, steps=2, every=2, keep=2) == 0
    ckpt = run / "ckpt"
    ckpt.chmod(0o555)
    try:
        cmd = [*_without_root_override(), sys.executable, "-m", "recpipe", *_args(CONFIG, run, steps=4, every=2, keep=2)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        ckpt.chmod(0o755)
    assert out.returncode == EXIT_CHECKPOINT, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "cannot save checkpoint" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    assert f"cannot save checkpoint {ckpt / 'step_00000004'}" in lines[0] and "Permission denied" in lines[0]
    assert f"the newest complete checkpoint is still {ckpt / 'step_00000002'}" in lines[0]
    assert "Traceback" not in out.stderr
    assert latest_checkpoint(ckpt) == ckpt / "step_00000002"


# ------------------------------------------------- checkpoints are read as data, never run
class Payload:
    """What a crafted checkpoint file holds: unpickled by ``pickle.load`` (or
    ``torch.load(weights_only=False)``), it runs ``touch MARKER`` through ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def rerecord(path: Path) -> None:
    """Rewrite ``metadata.json`` of checkpoint ``path`` with its files' sizes and CRC-32 as they
    are now: what someone who changes a checkpoint's files can always do."""
    meta = json.loads((path / METADATA_FILE).read_text())
    world_size = meta.get("world_size", 1)
    meta["files"] = {name: record for rank in range(world_size) for name, record in file_records(path, rank, world_size).items()}
    (path / METADATA_FILE).write_text(json.dumps(meta))


def dcp_checkpoint(root: Path, step: int, state: dict, **record) -> Path:
    """A one-rank checkpoint ``root/step_<step>`` as a save writes it: the marker, DCP's files
    of ``state`` and ``metadata.json`` (with ``record``'s fields)."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / MARKER_FILE).write_text("")
    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / METADATA_FILE).write_text(json.dumps({"format": 2, "world_size": 1, "step": step, "epoch": 0,
                                                  "batch": step, **record}))
    rerecord(path)
    return path


def craft_metadata(path: Path, marker: Path) -> None:
    """Put a :class:`Payload` into DCP's ``.metadata`` of checkpoint ``path``, records updated."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # this test's own file
    metadata.planner_data = Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    rerecord(path)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_crafted_dcp_metadata_is_refused_and_runs_nothing(tmp_path, one_rank, capsys):
    marker = tmp_path / "ran"
    dcp_checkpoint(tmp_path / "ckpt", 1, {"model": {"w": torch.ones(3)}})  # an older, intact one
    crafted = dcp_checkpoint(tmp_path / "ckpt", 2, {"model": {"w": torch.ones(3)}})
    craft_metadata(crafted, marker)
    assert verify_checkpoint(crafted) == []  # the checksums match: they cannot tell
    refused = rf"refusing checkpoint file {crafted / '.metadata'}: it names posix\.system, which no checkpoint holds"
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}"])
    with pytest.raises(UnsafeCheckpointError, match=refused):  # not skipped for the older one: refused
        choose_checkpoint(cfg.checkpoint)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        dcp_load({"model": {"w": torch.zeros(3)}}, crafted)
    assert main(["checkpoint", "verify", str(tmp_path / "ckpt")]) == EXIT_CHECKPOINT
    assert f"{crafted}: DAMAGED: refusing checkpoint file" in capsys.readouterr().out
    assert not marker.exists(), "a checkpoint's file ran code"


def test_a_non_tensor_value_is_read_as_data(tmp_path):
    """A value DCP stores with torch.save (a module's extra state) is read with torch's
    weights-only unpickler: plain data loads, a pickle that names code is refused."""
    marker = tmp_path / "ran"
    plain = dcp_checkpoint(tmp_path / "a", 1, {"model": {"w": torch.ones(3), "extra": "v2"}})
    state = {"model": {"w": torch.zeros(3), "extra": None}}
    dcp_load(state, plain, no_dist=True)
    assert state["model"]["extra"] == "v2" and torch.equal(state["model"]["w"], torch.ones(3))
    crafted = dcp_checkpoint(tmp_path / "b", 1, {"model": {"w": torch.ones(3), "extra": Payload(marker)}})
    with pytest.raises(UnsafeCheckpointError, match=r"refusing checkpoint file .*\(the value of model\.extra\): "
                                                    r"it names posix\.system"):
        dcp_load({"model": {"w": torch.zeros(3), "extra": None}}, crafted, no_dist=True)
    assert not marker.exists(), "a checkpoint's value ran code"


def test_a_rank_rng_file_that_names_code_is_refused_in_one_line(tmp_path, one_rank):
    marker = tmp_path / "ran"
    ckpt = dcp_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})
    torch.save({"cpu": Payload(marker)}, ckpt / "rng_rank00000.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"refusing checkpoint file {ckpt / 'rng_rank00000.pt'}: it names "
                                                    r"posix\.system"):
        store._restore_rng(ckpt, saved_world_size=1)
    assert not marker.exists()


@pytest.mark.slow
def test_a_real_checkpoint_reads_as_data_and_resumes_only_the_same_model(tmp_path, capsys):
    """What DCP's writer puts in ``.metadata`` for the trainer's state (tables row- and
    column-wise, Adagrad and Adam states) is what the restricted unpickler builds: the same
    Metadata as pickle's. A resume with another model is refused before any process starts."""
    run = tmp_path / "run"
    assert _train(CONFIG, run, steps=1, every=1) == 0
    ckpt = run / "ckpt" / "step_00000001"
    assert read_metadata(ckpt) == pickle.loads((ckpt / ".metadata").read_bytes())  # this test's own file
    capsys.readouterr()
    for override, named in [("model.embedding_dim=16", "model.embedding_dim=8 (this run: 16)"),
                            ("model.num_embeddings_per_feature=[100, 300, 500, 999]",
                             "model.num_embeddings_per_feature=[100, 300, 500, 1000] (this run: [100, 300, 500, 999])"),
                            ("model.arch=dcnv2", "model.arch='dlrm' (this run: 'dcnv2')")]:
        extra = ["--set", override] + (["--set", "model.dense_arch_layer_sizes=[16, 16]"] if "dim" in override else [])
        assert main([*_args(CONFIG, run, steps=2, every=1), *extra]) == EXIT_BAD_CONFIG
        err = capsys.readouterr().err
        assert f"checkpoint.resume: {ckpt} was saved with {named}" in err and len(err.strip().splitlines()) == 1, err


def test_a_record_that_verifies_nothing_is_damaged(tmp_path):
    ckpt = dcp_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}})
    meta = json.loads((ckpt / METADATA_FILE).read_text())
    (ckpt / METADATA_FILE).write_text(json.dumps({**meta, "files": {}}))
    assert verify_checkpoint(ckpt) == [f"{METADATA_FILE}: 'files' lists no file, so nothing of the checkpoint would "
                                       "be verified"]
    listed = {name: record for name, record in meta["files"].items() if name != "__0_0.distcp"}
    (ckpt / METADATA_FILE).write_text(json.dumps({**meta, "files": listed}))
    assert verify_checkpoint(ckpt) == [f"__0_0.distcp is not in {METADATA_FILE}'s record of the files"]


def test_a_step_beyond_64_bits_is_damage_not_a_traceback(tmp_path, one_rank):
    ckpt = tmp_path / "ckpt"
    older = dcp_checkpoint(ckpt, 2, {"model": {"w": torch.ones(3)}})
    newest = dcp_checkpoint(ckpt, 4, {"model": {"w": torch.ones(3)}})
    meta = json.loads((newest / METADATA_FILE).read_text())
    (newest / METADATA_FILE).write_text(json.dumps({**meta, "step": 10**30}))
    cfg = load_config(None, [f"checkpoint.dir={ckpt}"])
    check_resume(cfg)  # before launch: the ranks find it damaged
    with pytest.warns(UserWarning, match=rf"skipping damaged checkpoint {newest}: {METADATA_FILE}: 'step' is missing "
                                         r"or not a count \(0 \.\. 2\^63 - 2\)"):
        assert choose_checkpoint(cfg.checkpoint).path == older
    shutil.rmtree(older)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no intact checkpoint .*step_00000004: "
                                                                        f"{METADATA_FILE}: 'step'"):
        choose_checkpoint(cfg.checkpoint)


def test_retention_deletes_only_what_recpipe_wrote(tmp_path):
    ckpt = tmp_path / "ckpt"
    older = dcp_checkpoint(ckpt, 2, {"model": {"w": torch.ones(3)}})
    (older / "notes.txt").write_text("mine")  # a user's file in a checkpoint directory
    newest = dcp_checkpoint(ckpt, 4, {"model": {"w": torch.ones(3)}})
    interrupted = ckpt / "step_00000003"
    interrupted.mkdir()
    (interrupted / MARKER_FILE).write_text("")
    (interrupted / "__0_0.distcp").write_bytes(b"partial")
    mine = {"step_foo/metadata.json": "{}", "step_00000099_notes/important.txt": "keep",
            "step_00000005/todo.txt": "keep", "step_my_notes/todo.txt": "keep"}
    for name, text in mine.items():
        (ckpt / name).parent.mkdir(exist_ok=True)
        (ckpt / name).write_text(text)
    assert latest_checkpoint(ckpt) == newest  # step_foo/ holds a metadata.json, and is no checkpoint
    with pytest.warns(UserWarning, match=rf"checkpoint.keep=1: deleted the checkpoint in {older} but kept the "
                                         r"directory: it also holds notes.txt, which recpipe did not write"):
        store._prune(ckpt, keep=1)
    assert all((ckpt / name).read_text() == text for name, text in mine.items())
    assert [p.name for p in older.iterdir()] == ["notes.txt"] and not interrupted.exists()
    assert verify_checkpoint(newest) == []


def test_resume_refuses_a_model_of_other_shapes_before_any_process_starts(tmp_path):
    ckpt = tmp_path / "ckpt"
    model = [pair for pair in TINY if pair.startswith("model.")]
    saved = load_config(None, [f"checkpoint.dir={ckpt}", *model])
    dcp_checkpoint(ckpt, 2, {"model": {"w": torch.ones(3)}}, settings=resume_settings(saved))
    check_resume(saved)
    for override, named in [("model.embedding_dim=16", "model.embedding_dim=8 (this run: 16)"),
                            ("model.num_embeddings_per_feature=[100, 300, 500, 999]",
                             "model.num_embeddings_per_feature=[100, 300, 500, 1000] (this run: [100, 300, 500, 999])"),
                            ("model.arch=dcnv2", "model.arch='dlrm' (this run: 'dcnv2')")]:
        now = load_config(None, [f"checkpoint.dir={ckpt}", *model, override]
                          + (["model.dense_arch_layer_sizes=[16, 16]"] if "embedding_dim" in override else []))
        with pytest.raises(ConfigError, match=rf"checkpoint.resume: .*step_00000002 was saved with .*{re.escape(named)}"):
            check_resume(now)


def test_resume_refuses_a_factory_model_of_other_shapes(tmp_path):
    """A model.factory model's shapes are its code's: compared with the checkpoint's own."""
    ckpt = tmp_path / "ckpt"
    dcp_checkpoint(ckpt, 2, {"model": nn.Linear(4, 2).state_dict()})
    cfg = load_config(None, [f"checkpoint.dir={ckpt}"])
    check_resume_shapes(cfg.checkpoint, nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"holds another model than this run's \(weight: \[2, 4\] saved, \[3, 4\] in "
                                          r"the config's model; bias: \[2\] saved, \[3\]"):
        check_resume_shapes(cfg.checkpoint, nn.Linear(4, 3))
