"""User errors read as errors: one line with the exit code, printed by one rank for
the whole job (or by the rank that hit a rank-local one), the traceback only with
--debug; a reader's ValueError becomes a DataError with the reader's own message,
also when it comes back from a DataLoader worker process."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, IterableDataset

from recpipe.errors import CheckpointError, DataError, data_errors, report
from recpipe.exit_codes import EXIT_BAD_DATA, EXIT_CHECKPOINT


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
