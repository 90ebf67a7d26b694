"""Every input an operator may try ends with its documented exit code and one line, never
a traceback (docs/fault_tolerance.md, "When things go wrong"): damaged gzip data (5),
numbers beyond 64 bits or a boolean for a number (2), sizes this machine cannot hold (3,
before any process starts) or no tensor can (2), a hand-edited checkpoint record (a
damaged checkpoint: 6 when none is left), a hand-edited dataset manifest (5), output paths that are a mistake (2) or
cannot be written (6), rules between settings (2: a prefetch pipeline without a cached
table, a resume with another number of ranks or another optimizer). And what such a line
echoes of a bad field is cut short."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

from recpipe.checkpoint.integrity import METADATA_FILE
from recpipe.cli import main
from recpipe.config import load_config
from recpipe.data.criteo import parse_line, shown
from recpipe.exit_codes import (EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_CHECKPOINT, EXIT_DOES_NOT_FIT, EXIT_OK)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
TINY = ["model.num_embeddings_per_feature=[100, 300, 500, 1000]", "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16, 8]", "model.over_arch_layer_sizes=[16, 1]", "sharding.tables={}",
        "data.batch_size=16", "train.eval_every=0", "train.progress=false"]


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _train(tmp: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(CONFIG), *_sets(*TINY, f"logging.run_dir={tmp / 'run'}", *extra)]


def _one_line(err: str, code: int) -> str:
    """The one line of a user error: the last line of stderr, ending in its exit code."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("  warnings.warn")]
    assert lines and lines[-1].endswith(f"[exit {code}]"), err[-3000:]
    return lines[-1]


def _tsv_lines(n: int) -> bytes:
    return b"".join(b"\t".join([b"1", *[b"3"] * 13, *[b"%08x" % i] * 4]) + b"\n" for i in range(n))


def _damaged_gz(path: Path, lines: int, how: str) -> Path:
    data = gzip.compress(_tsv_lines(lines))
    if how == "truncated":
        data = data[: len(data) // 2]
    else:  # the CRC-32 in gzip's trailer no longer matches
        data = data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:]
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- damaged gzip data: 5
@pytest.mark.parametrize("how", ["truncated", "crc"])
def test_a_damaged_tsv_gz_is_bad_data_naming_the_file(tmp_path, capfd, how):
    day = _damaged_gz(tmp_path / "day_0.tsv.gz", 50, how)
    code = main(_train(tmp_path, "data.source=criteo_tsv", "data.num_workers=0", f"data.criteo.train_files=[{day}]"))
    line = _one_line(capfd.readouterr().err, EXIT_BAD_DATA)
    assert code == EXIT_BAD_DATA and f"{day}:1: the gzip data is damaged" in line, line

    code = main(["data", "convert", "--config", str(CONFIG), *_sets(*TINY[:4]), "--no-progress",
                 "--out", str(tmp_path / "bin"), str(day)])
    line = _one_line(capfd.readouterr().err, EXIT_BAD_DATA)
    assert code == EXIT_BAD_DATA and line.startswith(f"recpipe data convert: {day}:1: the gzip data is damaged"), line


@pytest.mark.slow
def test_gzip_damage_far_into_a_file_stops_training_as_bad_data(tmp_path, capfd):
    day = _damaged_gz(tmp_path / "day_0.tsv.gz", 40000, "truncated")  # the first lines read fine
    code = main(_train(tmp_path, "data.source=criteo_tsv", "data.num_workers=0", f"data.criteo.train_files=[{day}]",
                       "train.steps=10000", "distributed.nproc=2"))
    err = capfd.readouterr().err
    line = _one_line(err, EXIT_BAD_DATA)
    assert code == EXIT_BAD_DATA and "bad training data: " in line and f"{day}:" in line, line
    assert err.count("bad training data") == 1, err  # both ranks read past the damage: one says it
    assert "the gzip data is damaged (Compressed file ended before the end-of-stream marker was reached)" in line


# ---------------------------------------------------------------- numbers: 2 and 3
@pytest.mark.parametrize("override, says", [
    ("train.steps=100000000000000000000000", "train.steps: larger than 2^63 - 1"),
    ("data.batch_size=true", "data.batch_size: true is not a number"),
    ("optimizer.dense.lr=false", "optimizer.dense.lr: false is not a number"),
    ("model.num_embeddings_per_feature=[100, true, 500, 1000]", "model.num_embeddings_per_feature: true is not a number"),
])
def test_numbers_beyond_64_bits_and_booleans_for_numbers_are_config_errors(tmp_path, capfd, override, says):
    assert main(_train(tmp_path, override)) == EXIT_BAD_CONFIG
    assert says in capfd.readouterr().err


@pytest.mark.parametrize("overrides, term", [
    (["data.batch_size=10000000000000"], "input_batches"),
    (["model.embedding_dim=1000000000", "model.dense_arch_layer_sizes=[16, 1000000000]"], "emb_weights"),
    (["model.num_embeddings_per_feature=[1000000000000, 300, 500, 1000]"], "emb_weights"),
], ids=["batch", "embedding_dim", "rows"])
def test_sizes_this_machine_cannot_hold_are_refused_before_any_process_starts(tmp_path, capfd, overrides, term):
    code = main(_train(tmp_path, "distributed.nproc=2", *overrides))
    line = _one_line(capfd.readouterr().err, EXIT_DOES_NOT_FIT)
    assert code == EXIT_DOES_NOT_FIT
    assert line.startswith("recpipe train: refusing to start, the configuration does not fit in this machine's "
                           "memory: 2 rank(s) on CPU need about "), line
    assert term in line and "is available" in line
    assert not (tmp_path / "run").exists(), "something started"


def test_the_host_memory_check_counts_each_cpu_rank_s_process(monkeypatch, capfd):
    """Each CPU rank holds about 0.25 GiB beyond its plan's tensors (the interpreter, torch,
    torchrec, FBGEMM, Gloo: CPU_RANK_BYTES), about 14 times what quickstart's plan gives a
    rank: 64 ranks need about 17 GiB, not the 4.5 GiB of their plans."""
    from recpipe import preflight
    from recpipe.preflight import Machine, check_memory

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(preflight, "host_memory_available", lambda: 8 * 2**30)
    assert check_memory(load_config(CONFIG, ["distributed.nproc=2"]), Machine(cuda=False), world_size=2) is None
    cfg = load_config(CONFIG, ["distributed.nproc=64"])
    assert check_memory(cfg, Machine(cuda=False), world_size=64) == EXIT_DOES_NOT_FIT
    line = _one_line(capfd.readouterr().err, EXIT_DOES_NOT_FIT)
    assert line.startswith("recpipe train: refusing to start, the configuration does not fit in this machine's memory: "
                           "64 rank(s) on CPU need about 16.96 GiB: 256.0 MiB a rank for its process (measured"), line
    assert "8.00 GiB is available" in line and "lower distributed.nproc" in line


@pytest.mark.parametrize("overrides, says", [
    (["model.num_embeddings_per_feature=[1000000000000000000, 300, 500, 1000]"],
     "model.num_embeddings_per_feature[0]=1000000000000000000 x model.embedding_dim=8: a weight of "
     "1000000000000000000 x 8 float32 values (3.2e+19 bytes) is larger than a torch tensor can be (2^63 bytes)"),
    (["model.embedding_dim=1000000000000000000", "model.dense_arch_layer_sizes=[16, 1000000000000000000]"],
     "model.num_embeddings_per_feature[0]=100 x model.embedding_dim=1000000000000000000: a weight of"),
    (["model.dense_arch_layer_sizes=[1000000000000000000, 8]"], "model.dense_arch_layer_sizes[0]=1000000000000000000: a weight of"),
    (["model.over_arch_layer_sizes=[1000000000000000000, 1]"], "model.over_arch_layer_sizes[0]=1000000000000000000: a weight of"),
    (["model.arch=dcnv2", "model.dcn_low_rank_dim=100000000000000000"], "model.dcn_low_rank_dim=100000000000000000 x"),
], ids=["rows", "embedding_dim", "dense_layer", "over_layer", "dcn_rank"])
def test_sizes_no_tensor_can_hold_are_config_errors_for_every_command(tmp_path, capfd, overrides, says):
    """Below 2^63 each, but a weight of 2^63 bytes or more, which torch cannot make even on
    the meta device: one line naming the key from train, plan and bench, before any rank starts."""
    sets = _sets(*TINY, f"logging.run_dir={tmp_path / 'run'}", "distributed.nproc=2", *overrides)
    for command in (["train"], ["plan"], ["bench", "--steps", "2", "--warmup", "1", "--trace-steps", "0", "--no-plots",
                                          "--out", str(tmp_path / "bench")]):
        code = main([command[0], "--config", str(CONFIG), *sets, *command[1:]])
        line = _one_line(capfd.readouterr().err, EXIT_BAD_CONFIG)
        assert code == EXIT_BAD_CONFIG and line.startswith(f"recpipe {command[0]}: invalid config") and says in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "bench").exists(), "something started"


# ---------------------------------------------------------------- rules between settings: 2
def test_a_prefetch_pipeline_without_a_cached_table_is_refused(tmp_path, capfd):
    assert main(_train(tmp_path, "pipeline.name=prefetch")) == EXIT_BAD_CONFIG
    assert "pipeline.name='prefetch' prefetches the rows of UVM-cached tables" in capfd.readouterr().err


def test_more_cpu_ranks_than_cores_is_said_once(monkeypatch):
    from recpipe.preflight import Machine, check_machine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config(CONFIG, ["distributed.nproc=6"])
    with pytest.warns(UserWarning, match="distributed.nproc=6: 6 CPU ranks on this machine's 2 usable core"):
        check_machine(cfg, Machine(cuda=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_machine(load_config(CONFIG, ["distributed.nproc=2"]), Machine(cuda=False))
        monkeypatch.setenv("RANK", "1")  # under torchrun every rank checks: rank 0 says it
        check_machine(cfg, Machine(cuda=False))


# ---------------------------------------------------------------- a trained checkpoint, hand-edited
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 2 ranks with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trained")
    assert main(_train(tmp, "distributed.nproc=2", "train.steps=4", "checkpoint.every=2",
                       f"checkpoint.dir={tmp / 'ckpt'}")) == EXIT_OK
    return tmp


def _copy(trained: Path, tmp: Path) -> Path:
    shutil.copytree(trained / "ckpt", tmp / "ckpt")
    return tmp / "ckpt"


@pytest.mark.slow
def test_a_hand_edited_checkpoint_record_is_a_damaged_checkpoint(trained, tmp_path, capfd):
    ckpt = _copy(trained, tmp_path)
    (ckpt / "step_00000004" / METADATA_FILE).write_text('{"format": 2}')
    resume = _train(tmp_path, "distributed.nproc=2", "train.steps=5", f"checkpoint.dir={ckpt}")
    assert main(resume) == EXIT_OK  # from the intact step 2, with a warning naming step 4
    out, err = capfd.readouterr()
    assert f"resumed from {ckpt / 'step_00000002'}" in out
    assert f"skipping damaged checkpoint {ckpt / 'step_00000004'}: {METADATA_FILE}: 'batch' is missing" in err

    for step in ("step_00000002", "step_00000005"):
        (ckpt / step / METADATA_FILE).write_text('{"format": 2, "step": 1, "epoch": 0, "batch": 1, "world_size": 2}')
    assert main(resume) == EXIT_CHECKPOINT
    line = _one_line(capfd.readouterr().err, EXIT_CHECKPOINT)
    assert f"no intact checkpoint in checkpoint.dir={str(ckpt)!r}" in line and "format 2 but no 'files' record" in line


@pytest.mark.slow
@pytest.mark.parametrize("change, says", [
    ("distributed.nproc=1", "distributed.nproc=2 (this run: 1)"),
    ("optimizer.embedding.name=sgd", "optimizer.embedding.name='rowwise_adagrad' (this run: 'sgd')"),
    ("optimizer.dense.name=sgd", "optimizer.dense.name='adagrad' (this run: 'sgd')"),
], ids=["nproc", "embedding-optimizer", "dense-optimizer"])
def test_a_resume_with_another_number_of_ranks_or_optimizer_is_refused(trained, tmp_path, capfd, change, says):
    ckpt = _copy(trained, tmp_path)
    code = main(_train(tmp_path, "distributed.nproc=2", "train.steps=6", f"checkpoint.dir={ckpt}", change))
    line = _one_line(capfd.readouterr().err, EXIT_BAD_CONFIG)
    assert code == EXIT_BAD_CONFIG
    assert f"checkpoint.resume: {ckpt / 'step_00000004'} was saved with {says}" in line, line


@pytest.mark.slow
def test_export_output_paths(trained, tmp_path, capfd):
    export = ["export", "--config", str(CONFIG), *_sets(*TINY), "--checkpoint", str(trained / "ckpt"), "--out"]
    (tmp_path / "adir").mkdir()
    for out, code, says in [
        (tmp_path / "adir", EXIT_BAD_CONFIG, f"--out {tmp_path / 'adir'} is a directory"),
        (tmp_path / "no" / "such" / "x.pt", EXIT_BAD_CONFIG, f"the directory {tmp_path / 'no' / 'such'} does not exist"),
        (Path("/proc/x.pt"), EXIT_CHECKPOINT, "cannot write --out /proc/x.pt: No such file or directory"),
    ]:
        assert main([*export, str(out)]) == code
        assert says in _one_line(capfd.readouterr().err, code)
    assert not (tmp_path / "no").exists(), "a missing directory was created"


# ---------------------------------------------------------------- datasets and data convert
def _converted(tmp: Path, capfd) -> Path:
    day = tmp / "day_0.tsv"
    day.write_bytes(_tsv_lines(64))
    assert main(["data", "convert", "--config", str(CONFIG), *_sets(*TINY[:4]), "--no-progress",
                 "--out", str(tmp / "bin"), str(day)]) == EXIT_OK
    capfd.readouterr()
    return tmp / "bin"


def test_a_hand_edited_manifest_is_bad_data(tmp_path, capfd):
    data = _converted(tmp_path, capfd)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "sources": "zz"}))
    says = f"{data / 'manifest.json'}: not a valid manifest: 'sources' must be a list"
    assert main(["data", "verify", str(data)]) == EXIT_BAD_DATA
    assert says in _one_line(capfd.readouterr().err, EXIT_BAD_DATA)
    assert main(_train(tmp_path, "data.source=binary", f"data.binary.train_dir={data}")) == EXIT_BAD_DATA
    assert says in _one_line(capfd.readouterr().err, EXIT_BAD_DATA)


def test_data_convert_output_paths(tmp_path, capfd):
    day = tmp_path / "day_0.tsv"
    day.write_bytes(_tsv_lines(8))
    afile = tmp_path / "afile"
    afile.write_text("x")
    convert = ["data", "convert", "--config", str(CONFIG), *_sets(*TINY[:4]), "--no-progress", "--out"]
    assert main([*convert, str(afile), str(day)]) == EXIT_BAD_CONFIG
    assert f"--out {afile} exists and is not a directory" in _one_line(capfd.readouterr().err, EXIT_BAD_CONFIG)
    assert main([*convert, "/proc/conv", str(day)]) == EXIT_CHECKPOINT
    assert "cannot create --out /proc/conv: No such file or directory" in _one_line(capfd.readouterr().err,
                                                                                    EXIT_CHECKPOINT)


def test_a_bad_field_is_echoed_cut_short(tmp_path, capfd):
    null = b"\0" * 5000
    with pytest.raises(ValueError) as err:
        parse_line(b"\t".join([b"1", null, *[b"3"] * 12, *[b"ab"] * 4]), [100] * 4, 13, "day.tsv:6")
    assert str(err.value) == f"day.tsv:6: dense column 0 (column 2) is not an integer: {shown(null)}"
    assert len(str(err.value)) < 120 and "(5000 bytes)" in str(err.value)
    assert shown(b"abc") == "'abc'"

    day = tmp_path / "day_0.tsv"
    day.write_bytes(_tsv_lines(4) + b"\t".join([b"1", *[b"3"] * 13, null, *[b"ab"] * 3]) + b"\n")
    assert main(["data", "convert", "--config", str(CONFIG), *_sets(*TINY[:4]), "--no-progress",
                 "--out", str(tmp_path / "bin"), str(day)]) == EXIT_BAD_DATA
    line = _one_line(capfd.readouterr().err, EXIT_BAD_DATA)
    assert f"{day}:5: categorical column 0 (column 15) is not hex: " in line and len(line) < 250, line


def _symlink_loop(tmp: Path) -> Path:
    (tmp / "a").symlink_to(tmp / "b")
    (tmp / "b").symlink_to(tmp / "a")
    return tmp / "a"


@pytest.mark.parametrize("key", ["checkpoint.dir", "logging.run_dir"])
@pytest.mark.parametrize("path, says", [
    (lambda tmp: tmp / ("x" * 256), "File name too long"),
    (lambda tmp: tmp / "new" / ("x" * 256) / "ckpt", "File name too long: a component of 256 bytes, 255 at most"),
    (lambda tmp: tmp / "/".join(["y" * 200] * 21), "File name too long"),
    (lambda tmp: _symlink_loop(tmp), "Too many levels of symbolic links"),
    (lambda tmp: _symlink_loop(tmp) / "ckpt", "Too many levels of symbolic links"),
], ids=["long-name", "long-name-below-a-new-dir", "long-path", "symlink-loop", "in-a-symlink-loop"])
def test_a_run_directory_the_system_cannot_resolve_is_refused_before_any_process_starts(tmp_path, capfd, key, path,
                                                                                           says):
    directory = path(tmp_path)
    run = tmp_path / "run" if key == "checkpoint.dir" else directory
    code = main(_train(tmp_path, "train.steps=2", f"{key}={directory}", f"logging.run_dir={run}"))
    line = _one_line(capfd.readouterr().err, EXIT_CHECKPOINT)
    assert code == EXIT_CHECKPOINT
    assert line.startswith(f"recpipe train: cannot use {key}='{str(directory)[:80]}") and says in line, line
    assert not list(tmp_path.glob("new")), "created before the refusal"
