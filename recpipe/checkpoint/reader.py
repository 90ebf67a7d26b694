"""Reading a checkpoint without running code.

A checkpoint is data, and reading one must never run code it names. Two readers of
``torch.distributed.checkpoint`` (DCP) would: ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with ``pickle.load``, and ``DefaultLoadPlanner.load_bytes``
reads a non-tensor value with ``torch.load(weights_only=False)``. A pickle can name any
callable (``os.system``) and have it called, and ``metadata.json``'s checksums cannot
help: whoever can change a file of the checkpoint can change them too. recpipe reads
through :class:`CheckpointReader` and :class:`CheckpointLoadPlanner` instead:

* ``.metadata`` with an unpickler that builds only what DCP's own writer puts there
  (``_METADATA_GLOBALS``: DCP's metadata dataclasses, ``torch.Size``, dtypes and
  layouts, the checkpoint's path);
* non-tensor values (a module's extra state) with torch's weights-only unpickler, as
  DCP already reads every tensor and recpipe each rank's RNG state.

A file that names anything else is refused with :class:`UnsafeCheckpointError` (exit 6),
naming the file and what it names, before any of it is built. Checked against what DCP
writes and reads with torch 2.11 and 2.13: the same classes, modules and ``read_metadata``
behaviour (``tests/test_checkpoint.py`` lists them from a real checkpoint).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import ReadItem

from recpipe.compat import torch as compat_torch
from recpipe.errors import CheckpointError

__all__ = ["MODEL_PREFIX", "CheckpointLoadPlanner", "CheckpointReader", "UnsafeCheckpointError", "dcp_load",
           "model_tensors", "read_metadata", "safe_torch_load", "shape_differences"]

DCP_METADATA = ".metadata"  # DCP's index of every stored tensor, written by rank 0

_DCP_CLASSES = (dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
                dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
                dcp_metadata.StorageMeta, *compat_torch.dcp_metadata_private_globals())
# Every global a ``.metadata`` of DCP's FileSystemWriter names, by the (module, name) the
# pickle records; each is safe to call with any arguments (a dataclass, an Enum, torch.Size,
# a path, torch's lookup of a layout by name) or is a constant (a dtype).
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _DCP_CLASSES},
    ("torch", "Size"): torch.Size,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    # StorageMeta.checkpoint_id: the directory DCP saved to, as a path
    **{(cls.__module__, cls.__qualname__): cls for cls in (pathlib.PosixPath, pathlib.PurePosixPath)},
    **{("pathlib", cls.__name__): cls for cls in (pathlib.PosixPath, pathlib.PurePosixPath)},
}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names something a checkpoint does not hold (code to run): refused."""


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``_METADATA_GLOBALS`` (the Python docs'
    "Restricting Globals"): a pickle can call only what ``find_class`` returns."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


def _refusal(where: str | Path, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing checkpoint file {where}: it names {name}, which no checkpoint holds (reading it would run that "
        "code); recpipe reads checkpoints as data only: move this checkpoint away, or restore it from a copy you trust")


def _weights_only_refusal(err: pickle.UnpicklingError, where: str | Path) -> UnsafeCheckpointError:
    """torch's weights-only unpickler's refusal (several lines) as one line naming ``where``
    and the global it refused."""
    named = re.search(r"GLOBAL (\S+)", str(err))
    return _refusal(where, named[1] if named else str(err).strip().splitlines()[0])


def read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of checkpoint directory ``path``, unpickled without running code:
    ``UnsafeCheckpointError`` when it names anything but ``_METADATA_GLOBALS``,
    ``CheckpointError`` when it cannot be read or is not DCP metadata."""
    file = Path(path) / DCP_METADATA
    try:
        with open(file, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except _Refused as refused:
        raise _refusal(file, refused.name) from None
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint file {file}: {err.strerror or err}") from None
    except Exception as err:  # a damaged pickle: truncated, or not of DCP's dataclasses
        raise CheckpointError(f"checkpoint file {file} is not DCP metadata: {type(err).__name__}: {err}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"checkpoint file {file} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` unpickles with :func:`read_metadata`.
    recpipe never writes DCP's per-rank ``__R.metadata`` (DCP saves with collectives), so a
    rank's metadata is the global one."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(self.path)
        # as FileSystemReader.read_metadata does: this load's id in the storage metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_torch_load(source: str | Path | BinaryIO, where: str | Path) -> Any:
    """``torch.load`` with torch's weights-only unpickler (tensors, plain containers and
    the globals torch allows); a pickle that names another global is refused in one
    line naming ``where`` (its file) and that global."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _weights_only_refusal(err, where) from None


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that reads a non-tensor value of checkpoint ``path``
    with :func:`safe_torch_load`."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = safe_torch_load(value, f"{self.path} (the value of {fqn})")
        if self.flatten_state_dict:
            compat_torch.dcp_set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def dcp_load(state: dict, path: str | Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` of checkpoint ``path`` into ``state`` (in place) without running code
    the checkpoint names. A failure on any rank raises one ``CheckpointError`` (an
    ``UnsafeCheckpointError`` for a refused file) on every rank, in one line."""
    read_metadata(path)  # refused here in one line: DCP would log its own failed read with a traceback
    try:
        dcp.load(state, storage_reader=CheckpointReader(str(path)), planner=CheckpointLoadPlanner(path),
                 no_dist=no_dist)
    except CheckpointException as err:  # raised on every rank
        failed_rank, (exc, _) = min(err.failures.items())
        if isinstance(exc, UnsafeCheckpointError):
            raise UnsafeCheckpointError(str(exc)) from None
        if isinstance(exc, pickle.UnpicklingError):  # DCP's own weights-only read of a tensor
            raise _weights_only_refusal(exc, f"{path} (a tensor's data)") from None
        lines = str(exc).strip().splitlines()
        raise CheckpointError(f"cannot load checkpoint {path} (rank {failed_rank}: "
                              f"{lines[0] if lines else type(exc).__name__})") from None


MODEL_PREFIX = "model."  # the model's state in a checkpoint (recpipe.checkpoint.store._dcp_state)


def model_tensors(path: str | Path) -> dict[str, dcp_metadata.TensorStorageMetadata]:
    """What checkpoint ``path`` holds of each tensor of the model (global shape, dtype), by
    its key in the unsharded model's ``state_dict``; read without running code."""
    saved = read_metadata(path).state_dict_metadata
    return {key.removeprefix(MODEL_PREFIX): meta for key, meta in saved.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, dcp_metadata.TensorStorageMetadata)}


def shape_differences(stored: dict[str, dcp_metadata.TensorStorageMetadata],
                      target: dict[str, torch.Tensor]) -> list[str]:
    """Each tensor of ``target`` (a model's ``state_dict``) whose shape in ``stored``
    (:func:`model_tensors`) differs, as "key: [saved] saved, [shape] in the config's model"."""
    return [f"{key}: {list(stored[key].size)} saved, {list(t.shape)} in the config's model"
            for key, t in target.items() if key in stored and tuple(stored[key].size) != tuple(t.shape)]
