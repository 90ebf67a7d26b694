"""Checkpoints that move between TorchRec and recpipe: ``recpipe checkpoint convert``.

TorchRec users save a ``DistributedModelParallel`` with ``torch.distributed.checkpoint``
(DCP) as ``{"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}``, where the
optimizer is a ``KeyedOptimizer`` (``dmp.fused_optimizer``, or a ``CombinedOptimizer`` of
it and a ``KeyedOptimizerWrapper`` over the dense parameters). A recpipe checkpoint holds the
same model keys and the same optimizer states, one level higher: a ``KeyedOptimizer``'s
state_dict is ``{"state": {param: {name: tensor}}}`` (and ``param_groups`` when it was told
to save them), and recpipe stores ``state`` alone under ``optimizer``
(``recpipe.checkpoint.store._dcp_state``). So the two differ only in the names DCP records:

    TorchRec: optimizer.state.model.sparse_arch...t_cat_0.weight.t_cat_0.momentum1
    recpipe:  optimizer.model.sparse_arch...t_cat_0.weight.t_cat_0.momentum1

A DCP checkpoint keeps those names only in its ``.metadata``; the ``*.distcp`` files hold the
bytes at the offsets it records. Converting copies the data files unchanged and writes a
``.metadata`` with the other names: no model, no process group, and every tensor stays bit
for bit what was saved, in the sharding it was saved in (DCP reshards on load).

* ``--from torchrec SRC DST``: SRC is TorchRec's DCP directory, DST a ``checkpoint.dir``;
  it gets ``step_N/`` (``--step``, default 0) with recpipe's marker and ``metadata.json``
  (every file's size and CRC-32, data position epoch 0, batch 0). ``param_groups`` and any
  key besides ``model`` and ``optimizer`` are left out: recpipe sets the hyperparameters
  from its config. A resume of it needs the same model and the states of the config's
  optimizers; it has no RNG state and no number of ranks of its own.
* ``--to torchrec SRC DST``: SRC is a recpipe checkpoint (a ``checkpoint.dir``: its newest),
  verified against its record first; DST a new directory that TorchRec's ``dcp.load`` reads.

Both read the source's ``.metadata`` without running code
(``recpipe.checkpoint.reader.read_metadata``) and check that every file it names is
there and long enough before writing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import shutil
from pathlib import Path

from torch.distributed.checkpoint import metadata as dcp_metadata

from recpipe.checkpoint.integrity import (CONVERTED_FROM, MARKER_FILE, METADATA_FILE, SAVED_FILES, checkpoint_dirs,
                                          file_records)
from recpipe.checkpoint.reader import DCP_METADATA, read_metadata
from recpipe.checkpoint.store import FORMAT_VERSION, resolve_checkpoint
from recpipe.config import ConfigError
from recpipe.errors import CheckpointError, storage_problem
from recpipe.sections import INT64_MAX

__all__ = ["from_torchrec", "main_convert", "to_torchrec"]

_STATE = "optimizer.state."  # a KeyedOptimizer's state under TorchRec's "optimizer"
_OPTIMIZER = "optimizer."  # the same state in recpipe's layout
_PARAM_GROUPS = "optimizer.param_groups."  # a KeyedOptimizer's hyperparameters, when it saves them


def _recpipe_name(fqn: str) -> str | None:
    """The name recpipe gives TorchRec's ``fqn``; None for what recpipe does not keep."""
    if fqn.startswith("model."):
        return fqn
    if fqn.startswith(_STATE):
        return _OPTIMIZER + fqn.removeprefix(_STATE)
    return None


def _torchrec_name(fqn: str) -> str:
    """The name TorchRec gives recpipe's ``fqn``."""
    return _STATE + fqn.removeprefix(_OPTIMIZER) if fqn.startswith(_OPTIMIZER) else fqn


def _path_renamed(path: tuple, to_torchrec: bool) -> tuple:
    """An optimizer state's path in the nested state_dict (DCP's ``planner_data``) in the other layout."""
    if path[:1] != ("optimizer",):
        return path
    return ("optimizer", "state", *path[1:]) if to_torchrec else ("optimizer", *path[2:])


def _renamed(metadata: dcp_metadata.Metadata, to_torchrec: bool, checkpoint_id: Path) -> dcp_metadata.Metadata:
    """``metadata`` with every name in the other layout; what recpipe does not keep is left out."""
    rename = _torchrec_name if to_torchrec else _recpipe_name
    names = {fqn: new for fqn in metadata.state_dict_metadata if (new := rename(fqn)) is not None}
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):  # DCP's flattening: each name's path in the nested state_dict
        planner_data = {names[fqn]: _path_renamed(tuple(path), to_torchrec)
                        for fqn, path in planner_data.items() if fqn in names}
    storage_meta = metadata.storage_meta
    if storage_meta is not None:
        storage_meta = dataclasses.replace(storage_meta, checkpoint_id=checkpoint_id)
    return dataclasses.replace(
        metadata,
        state_dict_metadata={names[fqn]: meta for fqn, meta in metadata.state_dict_metadata.items() if fqn in names},
        planner_data=planner_data,
        storage_data={dataclasses.replace(index, fqn=names[index.fqn]): info
                      for index, info in metadata.storage_data.items() if index.fqn in names},
        storage_meta=storage_meta,
    )


def _data_files(src: Path, metadata: dcp_metadata.Metadata) -> list[str]:
    """The data files ``metadata`` names, each checked to be a DCP data file of ``src`` that holds
    every byte range recorded in it (a truncated copy is refused before anything is written)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = str(info.relative_path)
        if not SAVED_FILES.fullmatch(name) or not name.endswith(".distcp"):
            raise CheckpointError(f"{src / DCP_METADATA} names the data file {name!r}, which is not a DCP data file "
                                  "(__R_N.distcp)")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = src / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {src}: {name} is missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"checkpoint {src}: {name} has {file.stat().st_size} bytes, its metadata needs "
                                  f"{end} (truncated?)")
    return sorted(needed)


def _write(src: Path, dst: Path, metadata: dcp_metadata.Metadata, files: list[str]) -> None:
    for name in files:
        shutil.copyfile(src / name, dst / name)
    with open(dst / DCP_METADATA, "wb") as fh:
        pickle.dump(metadata, fh)  # as DCP's FileSystemWriter writes it


def from_torchrec(src: str | Path, dst_root: str | Path, step: int = 0) -> Path:
    """TorchRec's DCP checkpoint ``src`` as the recpipe checkpoint ``dst_root/step_{step}``
    (``dst_root`` must hold no checkpoint); returns its directory."""
    src, dst_root = Path(src), Path(dst_root)
    source = read_metadata(src)  # CheckpointError: not DCP's; UnsafeCheckpointError: names code
    if not any(fqn.startswith("model.") for fqn in source.state_dict_metadata):
        raise CheckpointError(f"{src} holds no 'model' state (TorchRec saves {{'model': dmp.state_dict(), "
                              "'optimizer': optimizer.state_dict()}})")
    if any(fqn.startswith(_OPTIMIZER) and not fqn.startswith((_STATE, _PARAM_GROUPS))
           for fqn in source.state_dict_metadata):
        raise CheckpointError(f"{src}: its 'optimizer' is not a KeyedOptimizer's state_dict ({{'state': ..., "
                              "'param_groups': ...}}); is it a recpipe checkpoint already?")
    if checkpoint_dirs(dst_root):
        raise CheckpointError(f"{dst_root} already holds checkpoints; convert into an empty checkpoint.dir")
    dst = dst_root / f"step_{step:08d}"
    metadata = _renamed(source, False, dst)
    files = _data_files(src, metadata)
    dst.mkdir(parents=True)
    (dst / MARKER_FILE).write_text(f"recpipe checkpoint of step {step} converted from TorchRec's {src}: "
                                   f"{METADATA_FILE} is written last, once it is complete\n")
    _write(src, dst, metadata, files)
    # world_size: a resume reads it only for RNG states and the number of ranks, which a converted one lacks
    record = {"format": FORMAT_VERSION, "world_size": 1, "step": step, "epoch": 0, "batch": 0,
              "files": file_records(dst, 0, 1), CONVERTED_FROM: "torchrec"}
    (dst / (METADATA_FILE + ".tmp")).write_text(json.dumps(record, indent=2) + "\n")
    (dst / (METADATA_FILE + ".tmp")).rename(dst / METADATA_FILE)
    return dst


def to_torchrec(src: str | Path, dst: str | Path) -> Path:
    """The recpipe checkpoint ``src`` (a checkpoint, or a ``checkpoint.dir``: its newest),
    verified, as a DCP checkpoint ``dst`` (new or empty) that TorchRec loads; returns ``src``'s
    checkpoint."""
    chosen = resolve_checkpoint(src, what="SRC")  # every file's size and CRC-32 against its record
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"DST {dst} already exists and is not an empty directory")
    metadata = _renamed(read_metadata(chosen), True, dst)
    files = _data_files(chosen, metadata)
    dst.mkdir(parents=True, exist_ok=True)
    _write(chosen, dst, metadata, files)
    return chosen


def main_convert(args: argparse.Namespace) -> int:
    """``recpipe checkpoint convert (--from torchrec | --to torchrec) SRC DST``; a file that cannot
    be read or written (read-only, full) is a ``CheckpointError`` naming it and why."""
    try:
        return _convert(args)
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        raise CheckpointError(f"cannot convert {args.src} into {args.dst} ({where}"
                              f"{storage_problem(err, args.dst)})") from None


def _convert(args: argparse.Namespace) -> int:
    if args.from_format:
        step = 0 if args.step is None else args.step
        if not 0 <= step < INT64_MAX:
            raise ConfigError(f"--step {step}: must be a count (0 .. 2^63 - 2)")
        written = from_torchrec(args.src, args.dst, step=step)
        print(f"{written}: TorchRec's checkpoint {args.src} as recpipe's, step {step}; resume it with "
              f"--set checkpoint.dir={Path(args.dst)}")
    else:
        if args.step is not None:
            raise ConfigError("--step goes with --from torchrec: --to torchrec writes no step (TorchRec's checkpoint "
                              "holds none)")
        chosen = to_torchrec(args.src, args.dst)
        print(f"{args.dst}: recpipe's checkpoint {chosen} as TorchRec's; load it with torch.distributed.checkpoint."
              f"load({{'model': dmp.state_dict(), 'optimizer': optimizer.state_dict()}}, "
              f"checkpoint_id={str(args.dst)!r})")
    return 0
