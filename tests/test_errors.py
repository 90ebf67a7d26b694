"""User errors read as errors: one line with the exit code, printed by one rank for
the whole job (or by the rank that hit a rank-local one), the traceback only with
--debug; a reader's ValueError becomes a DataError with the reader's own message,
also when it comes back from a DataLoader worker process. Bad input (a --set value
that is not YAML, a config file that is not UTF-8, an int or float out of range) is
one line naming the key, or the file and line (exit 2); a directory that cannot be
written names the path and the cause (exit 6)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, IterableDataset

from recpipe.cli import main
from recpipe.errors import CheckpointError, DataError, StorageError, data_errors, report, storage_problem
from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_CHECKPOINT


class _BadAtThree(IterableDataset):
    def __iter__(self):
        yield from range(3)
        raise ValueError("day_0.tsv:4: expected 40 tab-separated columns, got 3")


@pytest.mark.parametrize("workers", [0, 1])
def test_reader_errors_become_data_errors_with_the_readers_message(workers):
    loader = DataLoader(_BadAtThree(), batch_size=None, num_workers=workers)
    seen = []
    with pytest.raises(DataError) as err:
        for batch in data_errors(loader):
            seen.append(int(batch))
    assert seen == [0, 1, 2]
    assert str(err.value) == "bad training data: day_0.tsv:4: expected 40 tab-separated columns, got 3"
    assert err.value.exit_code == EXIT_BAD_DATA and not err.value.every_rank


def test_report_prints_once_for_the_job_and_the_traceback_only_with_debug(capsys):
    shared = CheckpointError("cannot save checkpoint /x/step_00000004 (rank 0: Permission denied)")
    assert report("train", shared, rank=1) == EXIT_CHECKPOINT
    assert capsys.readouterr().err == ""  # rank 0 says it for every rank
    assert report("train", shared, rank=0) == EXIT_CHECKPOINT
    assert capsys.readouterr().err == f"recpipe train: {shared} [exit {EXIT_CHECKPOINT}]\n"
    local = DataError("bad training data: day_0.tsv:4: ...", every_rank=False)
    try:
        raise local
    except DataError:
        assert report("train", local, rank=1, debug=True) == EXIT_BAD_DATA
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith(f"recpipe train: rank 1: {local} [exit {EXIT_BAD_DATA}]\n")


# ------------------------------------------------------------- bad input: exit 2, one line
CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"


@pytest.mark.parametrize("config, override, says", [
    (None, "train.steps=[1", "--set train.steps=[1: not a YAML value (line 1, column 3: expected ',' or ']'"),
    (None, "train.seed=99999999999999999999999", "train.seed: Input should be less than 9223372036854775808"),
    (None, "optimizer.dense.lr=.inf", "optimizer.dense.lr: Input should be a finite number (got inf)"),
    (None, "optimizer.embedding.lr=.nan", "optimizer.embedding.lr: Input should be a finite number (got nan)"),
    ("steps: 5\n  \xff", None, "line 2, column 3: byte 0xff is not UTF-8 text"),
    ("train:\n  steps: [5\n", None, "is not valid YAML: line 3, column 1: expected ',' or ']'"),
])
def test_bad_input_is_one_line_naming_the_key_or_the_file_and_line(tmp_path, capsys, config, override, says):
    path = CONFIG
    if config is not None:
        path = tmp_path / "bad.yaml"
        path.write_bytes(config.encode("latin-1"))  # \xff: one byte that is not UTF-8
    args = ["train", "--config", str(path)] + (["--set", override] if override else [])
    assert main(args) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and f"[exit {EXIT_BAD_CONFIG}]" in err, err
    if config is not None:
        assert repr(str(path)) in err


# --------------------------------------------------- storage: exit 6, naming path and cause
def test_storage_problems_name_the_cause(tmp_path, monkeypatch):
    assert storage_problem(OSError(errno.ENOSPC, "No space left on device"), tmp_path) == "No space left on device"
    try:  # torch's writers re-raise with their own message: the errno is found where it came from
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as cause:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598") from cause
    except RuntimeError as err:
        assert storage_problem(err, tmp_path) == "Read-only file system"
    # No errno at all (torch.save's zip writer after a short write): a full filesystem says so.
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598")
    full = os.statvfs_result((4096, 4096, 100, 0, 0, 10, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    assert storage_problem(short_write, tmp_path / "ckpt" / "step_00000004") == "No space left on device"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_run_dir_that_cannot_be_written_is_a_storage_error(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full filesystem does."""
    from recpipe.config import load_config
    from recpipe.train.run_dir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").symlink_to("/dev/full")
    with pytest.raises(StorageError) as err:
        RunDir(load_config(CONFIG, [f"logging.run_dir={run}"]), rank=0)
    config = run / "config.yaml"
    assert str(err.value) == f"cannot write logging.run_dir={str(run)!r} ({config}): No space left on device"
    assert err.value.exit_code == EXIT_CHECKPOINT and err.value.every_rank
    (run / "config.yaml").unlink()
    run_dir = RunDir(load_config(CONFIG, [f"logging.run_dir={run}", "logging.tensorboard=false"]), rank=0)
    (run / "summary.json").symlink_to("/dev/full")
    with pytest.raises(StorageError, match=r"\(.*summary.json\): No space left on device") as err:
        run_dir.write_summary({"status": "completed"})
    assert not err.value.every_rank  # rank 0's alone: it reports it, the launcher ends the others


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_checkpoint_write_on_a_full_disk_names_the_path_and_the_newest_checkpoint(tmp_path):
    """The first file of a save (this rank's RNG state) written to /dev/full: ENOSPC,
    not torch.save's "unexpected pos" without an errno."""
    import torch.distributed as dist

    from recpipe.config import load_config
    from recpipe.checkpoint.store import _agreed, _write_rng
    from recpipe.checkpoint.integrity import METADATA_FILE

    older, path = tmp_path / "step_00000002", tmp_path / "step_00000004"
    older.mkdir()
    (older / METADATA_FILE).write_text("{}")
    path.mkdir()
    (path / "rng_rank00000.pt").symlink_to("/dev/full")
    cfg = load_config(None, [f"checkpoint.dir={tmp_path}"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError) as err:
            _agreed(cfg.checkpoint, path, lambda: _write_rng(path, 0))
    finally:
        dist.destroy_process_group()
    assert str(err.value) == (f"cannot save checkpoint {path} (rank 0: No space left on device); "
                              f"the newest complete checkpoint is still {older}")
    assert err.value.exit_code == EXIT_CHECKPOINT
