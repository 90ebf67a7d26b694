"""``recpipe data convert``: Criteo-layout TSV files (plain or gzip) -> a binary dataset.

Each input file becomes one part (``binary_format``), converted by one process of a
pool (``--workers``, default one per core); rows keep the order of the lines, and
parts the order of the files on the command line, so the dataset's row stream is
the TSV reader's line stream. Lines are parsed 65536 at a time by
``criteo_block.parse_block`` (numpy, one-hot features), which gives the values of the TSV
reader's own ``parse_line`` (same id hashing, or TorchRec's with ``hashing="torchrec"``)
and hands back any block it would not parse exactly as ``parse_line`` does; such a block
(a malformed line, multi-hot fields, ...) is parsed line by line by ``parse_line``, so
every error, every skipped line and every value is ``parse_line``'s.

Restartable: the first run writes the manifest with the list of sources; each part's
entry is added when the part is complete. A later run with the same files skips the
finished parts (after checking that their sources did not change and that their
files still have the manifest's headers and sizes) and redoes the others. Column
files are written under temporary names (a ``.npy`` header with a placeholder row
count first, the real one once the rows are known: numpy pads the header to 128
bytes for any 2-D shape, so it is rewritten in place), fsynced, renamed, and only
then recorded.

Malformed lines raise ``ValueError("<file>:<line>: ...")``; with ``skip_malformed=N``
up to N malformed lines *per file* are skipped, counted and listed in the manifest
and in the report. A dense count must also fit the format's int32.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import multiprocessing
import os
import queue
import signal
import warnings
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from recpipe.data.binary_format import (
    HASHINGS,
    VERSION,
    BinaryDataError,
    Layout,
    Manifest,
    check_part_files,
    fsync_dir,
    part_name,
    read_manifest,
    write_npy_header,
)
from recpipe.data.criteo import open_lines, parse_line
from recpipe.data.criteo_block import parse_block
from recpipe.system import die_with_parent
from recpipe.errors import ConfigError, StopRequested, StorageError, storage_problem

__all__ = ["ConvertReport", "convert"]

_INT32_MAX = 2**31 - 1
_CHUNK_ROWS = 1 << 16  # lines parsed at once, then written out
_EXAMPLES = 5  # skipped lines listed per file


@dataclass
class ConvertReport:
    directory: Path
    converted: list[str] = field(default_factory=list)  # parts converted by this run
    already: list[str] = field(default_factory=list)  # parts finished before
    rows: int = 0  # rows of the whole dataset
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)  # source -> {"count", "examples"}

    def lines(self) -> list[str]:
        out = [f"{self.directory}: {self.rows:,} rows in {len(self.converted) + len(self.already)} parts "
               f"({len(self.converted)} converted now, {len(self.already)} already converted)"]
        total = sum(s["count"] for s in self.skipped.values())
        if total:
            out.append(f"skipped {total:,} malformed lines (--skip-malformed):")
            for source, s in self.skipped.items():
                out.append(f"  {source}: {s['count']:,}, e.g.")
                out.extend(f"    {example}" for example in s["examples"])
        return out


# ------------------------------------------------------------------- one part
class _HashingReader(io.RawIOBase):
    """The raw bytes of a file, hashed (SHA-256) and counted as they are read."""

    def __init__(self, path: str, on_bytes: Callable[[int], None]) -> None:
        self._fh = open(path, "rb")
        self.sha256 = hashlib.sha256()
        self._on_bytes = on_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._fh.readinto(buffer)
        if n:
            self.sha256.update(memoryview(buffer)[:n])
            self._on_bytes(n)
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


class _PartWriter:
    """Column files of one part under temporary names, with a SHA-256 of each one's data."""

    def __init__(self, manifest: Manifest, part: str) -> None:
        self.layout, self.rows = manifest.layout, 0
        self.final = {c: manifest.column_path(part, c) for c in self.layout.columns()}
        self.tmp = {c: p.with_name(f".{p.name}.tmp-{os.getpid()}") for c, p in self.final.items()}
        self.files = {c: open(p, "wb") for c, p in self.tmp.items()}
        self.header_bytes = {c: write_npy_header(self.files[c], dtype, (0, width))
                             for c, (dtype, width) in self.layout.columns().items()}
        self.hashes = {c: hashlib.sha256() for c in self.final}

    def write(self, table: np.ndarray) -> None:
        """``table``: int64 rows of label, D dense counts, then the ids of every feature."""
        start = 0
        for column, (dtype, width) in self.layout.columns().items():
            data = np.ascontiguousarray(table[:, start : start + width], dtype=dtype).tobytes()
            self.files[column].write(data)
            self.hashes[column].update(data)
            start += width
        self.rows += len(table)

    def commit(self) -> dict[str, Any]:
        for column, fh in self.files.items():
            dtype, width = self.layout.columns()[column]
            fh.seek(0)
            length = write_npy_header(fh, dtype, (self.rows, width))
            assert length == self.header_bytes[column], (column, length, self.header_bytes[column])
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        for column, tmp in self.tmp.items():
            os.replace(tmp, self.final[column])
        fsync_dir(next(iter(self.final.values())).parent)
        return {c: {"bytes": self.final[c].stat().st_size, "sha256": h.hexdigest()} for c, h in self.hashes.items()}

    def abort(self) -> None:
        for column, fh in self.files.items():
            fh.close()
            self.tmp[column].unlink(missing_ok=True)


def _parse(raw: bytes, layout: Layout, where: str, hashing: str) -> list[int]:
    label, dense, ids = parse_line(raw, list(layout.table_sizes), layout.num_dense, where, list(layout.hotness), hashing)
    for j, value in enumerate(dense):
        if value > _INT32_MAX:
            raise ValueError(f"{where}: dense column {j} (column {j + 2}) is {value}, beyond the binary format's "
                             f"int32 range (max {_INT32_MAX})")
    return [int(label), *dense, *ids]


@dataclass(frozen=True)
class _Task:
    source: str
    part: str
    manifest: Manifest  # of the dataset, as it was before this run (layout, hashing, paths)
    skip_malformed: int


class _Skips:
    """The malformed lines of one file skipped so far (``--skip-malformed``)."""

    def __init__(self, task: _Task) -> None:
        self.task, self.count, self.examples = task, 0, []

    def add(self, err: ValueError) -> None:
        limit, source = self.task.skip_malformed, self.task.source
        if self.count >= limit:
            if limit:
                raise ValueError(f"{err} (more than --skip-malformed={limit} malformed lines in {source})") from None
            raise err
        self.count += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(str(err))


def _parse_lines(lines: list[bytes], first: int, task: _Task, skips: _Skips) -> np.ndarray:
    """int64 rows of ``lines`` (line numbers from ``first``): a block at once where
    ``parse_block`` can, else line by line (its errors, its skipped lines)."""
    layout, hashing = task.manifest.layout, task.manifest.hashing
    if all(h == 1 for h in layout.hotness):
        table = parse_block(lines, list(layout.table_sizes), layout.num_dense, hashing)
        if table is not None:
            return table
    rows = []
    for lineno, line in enumerate(lines, start=first):
        try:
            rows.append(_parse(line, layout, f"{task.source}:{lineno}", hashing))
        except ValueError as err:
            skips.add(err)
    return np.array(rows, dtype=np.int64).reshape(len(rows), 1 + layout.num_dense + sum(layout.hotness))


def convert_file(task: _Task, on_bytes: Callable[[int], None]) -> dict[str, Any]:
    """Convert one TSV file into one finished part; returns its manifest entry."""
    stat = os.stat(task.source)
    raw = _HashingReader(task.source, on_bytes)
    writer = _PartWriter(task.manifest, task.part)
    skips = _Skips(task)
    try:
        with open_lines(task.source, raw) as lines:
            first, stream = 1, iter(lines)
            while chunk := list(islice(stream, _CHUNK_ROWS)):
                writer.write(_parse_lines(chunk, first, task, skips))
                first += len(chunk)
        files = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {
        "rows": writer.rows,
        "source": {"path": task.source, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                   "sha256": raw.sha256.hexdigest()},
        "skipped_malformed": skips.count,
        "skipped_examples": skips.examples,
        "files": files,
    }


# ------------------------------------------------------------ the whole run
_progress: Any = None  # the pool workers' progress queue (set by _init_worker)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _init_worker(progress: Any, parent_pid: int) -> None:
    """A pool worker (forked with SIGTERM and SIGINT blocked, see ``_run``): it dies with
    the converting process however that ends (a SIGKILL included), leaves SIGINT to it (a
    Ctrl-C reaches the whole group: the parent decides) and ends at once on SIGTERM (the
    pool's terminate, or the group's)."""
    global _progress
    _progress = progress
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _convert_in_worker(task: _Task) -> tuple[str, dict[str, Any]]:
    return task.part, convert_file(task, _progress.put)


def _open_manifest(out: Path, layout: Layout, sources: list[dict[str, str]], hashing: str) -> Manifest:
    if not (out / "manifest.json").exists():
        manifest = Manifest(out, layout, sources, {}, hashing)
        manifest.save()
        return manifest
    manifest = read_manifest(out)
    if manifest.version != VERSION:
        raise BinaryDataError(f"{out} holds a dataset of format version {manifest.version}, which recpipe still "
                              f"reads as it is; a conversion writes version {VERSION}: use another --out")
    problems = manifest.layout.differences(layout)
    if manifest.hashing != hashing:
        problems.append(f"ids hashed by {manifest.hashing}'s rule, this run hashes by {hashing}'s (--hashing)")
    if [s["path"] for s in manifest.sources] != [s["path"] for s in sources]:
        problems.append(f"sources {[s['path'] for s in manifest.sources]}, this run converts "
                        f"{[s['path'] for s in sources]} (same files in the same order to resume)")
    if problems:
        raise BinaryDataError(f"{out} holds another conversion: its manifest has " + "; ".join(problems) +
                              ". Use another --out, or delete the directory")
    return manifest


def _pending(manifest: Manifest) -> list[str]:
    """Parts to convert; finished parts whose files are damaged are redone (with a warning)."""
    todo = []
    for s in manifest.sources:
        entry = manifest.parts.get(s["part"])
        if entry is None:
            todo.append(s["part"])
            continue
        stat = os.stat(s["path"])
        recorded = entry["source"]
        if (stat.st_size, stat.st_mtime_ns) != (recorded["size"], recorded["mtime_ns"]):
            raise BinaryDataError(
                f"{s['path']} changed since it was converted into {s['part']} (size {recorded['size']} -> "
                f"{stat.st_size}, mtime_ns {recorded['mtime_ns']} -> {stat.st_mtime_ns}); use another --out"
            )
        damaged = check_part_files(manifest, s["part"])
        if damaged:
            warnings.warn(f"converting {s['path']} again: " + "; ".join(damaged), stacklevel=2)
            del manifest.parts[s["part"]]
            manifest.save()
            todo.append(s["part"])
    return todo


def _lock(out: Path) -> int:
    fd = os.open(out / ".convert.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BinaryDataError(f"{out}: another `recpipe data convert` is writing this directory") from None
    return fd


def convert(
    layout: Layout,
    files: list[str],
    out: str | Path,
    *,
    workers: int | None = None,
    skip_malformed: int = 0,
    progress: bool = True,
    hashing: str = "recpipe",
) -> ConvertReport:
    """Convert ``files`` into the dataset directory ``out`` (created if needed), ids
    hashed by ``hashing``'s rule (``binary_format.HASHINGS``)."""
    if hashing not in HASHINGS:
        raise ValueError(f"hashing={hashing!r}: choose one of {', '.join(HASHINGS)}")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"input files not found: {missing}")
    if len({os.path.abspath(f) for f in files}) != len(files):
        raise ValueError(f"an input file is named twice: {files}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory; a dataset is a directory: name a new one")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = _lock(out)
    except OSError as err:
        raise StorageError(f"cannot create --out {out}: {storage_problem(err, out)}") from None
    converted: list[str] = []
    try:
        for stale in out.glob(".*.tmp-*"):  # left by an interrupted run; the lock says none is running
            stale.unlink()
        sources = [{"path": os.path.abspath(f), "part": part_name(i, f)} for i, f in enumerate(files)]
        manifest = _open_manifest(out, layout, sources, hashing)
        todo = set(_pending(manifest))
        report = ConvertReport(out, already=[s["part"] for s in sources if s["part"] not in todo], converted=converted)
        target = Manifest(out, layout, [], {}, hashing)  # what a worker needs: paths, layout, hashing
        tasks = [_Task(s["path"], s["part"], target, skip_malformed) for s in sources if s["part"] in todo]
        total = sum(os.stat(t.source).st_size for t in tasks)
        with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=None if progress else True) as bar:
            for part, entry in _run(tasks, workers or os.cpu_count() or 1, bar.update):
                manifest.parts[part] = entry
                manifest.save()  # the entry last: the part now counts as finished
                report.converted.append(part)
    except StopRequested as stop:
        raise StopRequested(stop.signum, stop.what, f"after converting {len(converted)} more file(s): the parts "
                            "converted are kept, and the same command resumes") from None
    except OSError as err:
        written = err.filename is not None and Path(err.filename).resolve().is_relative_to(out.resolve())
        if not written:
            raise
        raise StorageError(f"cannot write --out {out} ({err.filename}): {storage_problem(err, out)}; the parts "
                           "converted so far are kept, and the same command resumes") from None
    finally:
        os.close(lock)
    report.rows = manifest.num_rows
    for s in manifest.sources:
        entry = manifest.parts[s["part"]]
        if entry["skipped_malformed"]:
            report.skipped[s["path"]] = {"count": entry["skipped_malformed"], "examples": entry["skipped_examples"]}
    return report


def _run(tasks: list[_Task], workers: int, on_bytes: Callable[[int], None]):
    """(part, entry) per task as they finish: in this process for one worker, else a pool."""
    if workers == 1 or len(tasks) <= 1:
        for task in tasks:
            yield task.part, convert_file(task, on_bytes)
        return
    # fork: the workers need no fresh interpreter (nothing to import again).
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    progress = ctx.Queue()
    # Blocked across the forks: a signal must not run this process's handlers in a worker
    # before _init_worker has set the worker's own.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pool = ctx.Pool(min(workers, len(tasks)), initializer=_init_worker, initargs=(progress, os.getpid()))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with pool:
        results = pool.imap_unordered(_convert_in_worker, tasks)
        remaining = len(tasks)
        while remaining:
            _drain(progress, on_bytes)
            try:
                yield results.next(timeout=0.2)
            except multiprocessing.TimeoutError:
                continue
            remaining -= 1
        _drain(progress, on_bytes)


def _drain(progress: Any, on_bytes: Callable[[int], None]) -> None:
    while True:
        try:
            on_bytes(progress.get_nowait())
        except queue.Empty:
            return
