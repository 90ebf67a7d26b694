"""Checkpoint integrity: every file's size and CRC-32, recorded at save, checked before load.

``metadata.json`` of a checkpoint (format 2) holds ``files``: for every other file
of the checkpoint directory its size and CRC-32. Each rank checksums the files it
wrote (DCP names them ``__R_N.distcp``; the RNG file is ``rng_rankR.pt``) and rank
0 the rest (DCP's ``.metadata``), so saving reads each file back once, from the
page cache, on the rank that wrote it. Verification splits the work the same way.
CRC-32 (zlib, ~3.7 GB/s on one core here) rather than a cryptographic hash: it is
meant to find truncated or damaged files, not tampering.

A record that lists no file verifies nothing and makes its checkpoint a damaged one; so
does a file that a save writes (a name ``SAVED_FILES`` matches) but the record does not list.

What recpipe wrote, it can tell apart from anything else in ``checkpoint.dir``: a
checkpoint directory is named ``step_`` and its step in 8 digits or more, and a save
writes ``MARKER_FILE`` into it before anything else and ``metadata.json`` after
everything else; inside, the files a save writes have the names ``SAVED_FILES`` matches.
Retention and every cleanup delete only those (``recpipe.checkpoint.store``).

``recpipe checkpoint verify DIR`` (:func:`main_checkpoint`) checks by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from pathlib import Path

from recpipe.checkpoint.reader import read_metadata
from recpipe.errors import CheckpointError
from recpipe.exit_codes import EXIT_CHECKPOINT
from recpipe.sections import INT64_MAX

__all__ = ["CONVERTED_FROM", "MARKER_FILE", "METADATA_FILE", "SAVED_FILES", "checkpoint_dirs", "checkpoint_step",
           "file_records", "main_checkpoint", "verify_checkpoint", "written_by_recpipe"]

METADATA_FILE = "metadata.json"
# metadata.json of a checkpoint converted from another format (recpipe.checkpoint.convert): which
CONVERTED_FROM = "converted_from"
MARKER_FILE = ".recpipe_checkpoint"  # a save writes it first: recpipe started writing this directory
# Every file a save writes (DCP's writes .metadata through .metadata.tmp, recpipe metadata.json
# through metadata.json.tmp).
SAVED_FILES = re.compile(r"(\.recpipe_checkpoint|\.metadata|__\d+_\d+\.distcp|rng_rank\d+\.pt|metadata\.json)(\.tmp)?")
_STEP_DIR = re.compile(r"step_(\d{8,})")  # recpipe.checkpoint.store.checkpoint_path's names
_CHUNK = 16 * 2**20
_WRITTEN_BY = (re.compile(r"__(\d+)_\d+\.distcp$"), re.compile(r"rng_rank(\d+)\.pt$"))


def checkpoint_step(path: Path) -> int | None:
    """The step of ``path`` if it is named as a save names a checkpoint directory, else None."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match[1]) if match else None


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """The directories of ``root`` named as a save names a checkpoint, oldest step first.
    Whether recpipe wrote one says its marker or its record (:func:`written_by_recpipe`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := checkpoint_step(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def written_by_recpipe(path: Path) -> bool:
    """Whether a save of recpipe wrote checkpoint directory ``path``: it holds the marker a
    save writes first, or (saved before there was a marker) a record of its own step."""
    if (path / MARKER_FILE).is_file():
        return True
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("step") == checkpoint_step(path)


def owner(name: str, world_size: int) -> int:
    """The rank that checksums file ``name``: the one that wrote it where the name
    says so, else rank 0."""
    for pattern in _WRITTEN_BY:
        match = pattern.match(name)
        if match and int(match.group(1)) < world_size:
            return int(match.group(1))
    return 0


def _record(file: Path) -> dict:
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return {"size": file.stat().st_size, "crc32": f"{crc:08x}"}


def file_records(path: Path, rank: int, world_size: int) -> dict[str, dict]:
    """Size and CRC-32 of the files of checkpoint ``path`` that ``rank`` owns."""
    names = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(METADATA_FILE))
    return {name: _record(path / name) for name in names if owner(name, world_size) == rank}


def verify_checkpoint(path: str | Path, rank: int = 0, world_size: int = 1,
                      checksums: bool = True) -> list[str] | None:
    """Problems of checkpoint ``path`` against its record: [] when intact, None when
    it has no record (saved by recpipe before format 2). Every file's size is
    checked; the contents only of the files ``rank`` of ``world_size`` owns, and only
    with ``checksums`` (without, a ``stat`` per file: no read)."""
    path = Path(path)
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as err:
        return [f"{METADATA_FILE} cannot be read: {err}"]
    problems = record_problems(meta)
    if problems:
        return problems
    files = meta.get("files")
    if files is None:
        return None
    problems = [f"{name} is not in {METADATA_FILE}'s record of the files" for name in sorted(
        p.name for p in path.iterdir() if SAVED_FILES.fullmatch(p.name) and not p.name.startswith(METADATA_FILE))
        if name not in files]
    for name, saved in sorted(files.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != saved["size"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, {saved['size']} were saved (truncated?)")
        elif checksums and owner(name, world_size) == rank and (crc := _record(file)["crc32"]) != saved["crc32"]:
            problems.append(f"{name} differs from what was saved (crc32 {crc}, saved {saved['crc32']})")
    return problems


POSITION = ("step", "epoch", "batch", "world_size")  # what a resume reads from every record


def record_problems(meta: object) -> list[str]:
    """What makes ``metadata.json``'s content (``meta``) not a checkpoint record recpipe
    wrote (hand-edited, or another program's): not an object, or a format 2 record
    without a record of its files' sizes and checksums."""
    if not isinstance(meta, dict):
        return [f"{METADATA_FILE} is not a JSON object"]
    files = meta.get("files")
    if files is None and meta.get("format", 1) != 1:
        return [f"{METADATA_FILE}: format {meta.get('format')!r} but no 'files' record"]
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("crc32"), str)
            for r in files.values())):
        return [f"{METADATA_FILE}: 'files' is not a record of every file's size and crc32"]
    if files is not None and not files:
        return [f"{METADATA_FILE}: 'files' lists no file, so nothing of the checkpoint would be verified"]
    return []


def position_problems(meta: dict) -> list[str]:
    """The fields of the training position a resume reads (``POSITION``) that are missing
    or not counts a run can continue from: below 2^63 - 1, so that the next step is
    within 64 bits too (TensorBoard's steps and torch's counters)."""
    return [f"{METADATA_FILE}: {key!r} is missing or not a count (0 .. 2^63 - 2)" for key in POSITION
            if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or not 0 <= meta[key] < INT64_MAX]


def _metadata_problems(path: Path) -> list[str]:
    """Why DCP's ``.metadata`` of ``path`` cannot be read as data (a resume refuses a
    checkpoint whose metadata names code to run), or []."""
    try:
        read_metadata(path)
    except CheckpointError as err:
        return [str(err)]
    return []


def main_checkpoint(args: argparse.Namespace) -> int:
    """``recpipe checkpoint verify DIR``: check every checkpoint in DIR (a
    ``checkpoint.dir``, or one ``step_*`` directory) against its record, and that its
    DCP metadata reads as data. Exit 0 when every complete checkpoint is intact,
    EXIT_CHECKPOINT otherwise."""
    root = Path(args.dir)
    paths = [root] if (root / METADATA_FILE).is_file() else [
        p for p in checkpoint_dirs(root) if (p / METADATA_FILE).is_file() or (p / MARKER_FILE).is_file()]
    damaged = complete = 0
    for path in paths:
        if not (path / METADATA_FILE).is_file():
            print(f"{path}: incomplete (no {METADATA_FILE}: the save was interrupted; resuming ignores it)")
            continue
        complete += 1
        problems = verify_checkpoint(path)
        if not problems:
            problems = _metadata_problems(path) or problems
        if problems is None:
            print(f"{path}: no checksums recorded (saved by an older recpipe); not verified")
        elif problems:
            damaged += 1
            print(f"{path}: DAMAGED: {'; '.join(problems)}")
        else:
            files = json.loads((path / METADATA_FILE).read_text())["files"]
            print(f"{path}: ok ({len(files)} files, {sum(f['size'] for f in files.values()) / 2**20:.2f} MiB)")
    if not complete or damaged:
        what = f"{damaged} damaged checkpoint(s)" if damaged else "no complete checkpoint"
        print(f"recpipe checkpoint: {what} in {root} [exit {EXIT_CHECKPOINT}]")
        return EXIT_CHECKPOINT
    return 0
