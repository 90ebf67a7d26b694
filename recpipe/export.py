"""``recpipe export --config C --checkpoint DIR --out FILE [--fp16-tables]``: a sharded
checkpoint -> one unsharded ``state_dict`` file that plain PyTorch loads.

The checkpoint (``recpipe.checkpoint.store``: DCP, tables as ShardedTensors split
row- or column-wise over any number of ranks) is read without a process group by
``torch.distributed.checkpoint.load`` into full tensors of the unsharded model's
shapes, without running code it names (``recpipe.checkpoint.reader``: a crafted
file is refused, exit 6): DCP reassembles each tensor from the stored shards that overlap it. The
keys and shapes come from the config's model (``model.factory`` or the built-in
DLRM/DCNv2) built on the meta device, so a checkpoint of another model is an error
naming what differs. Only the model is exported (no optimizer state).

Memory: the dense tensors are loaded in one read, then each embedding table in a
read of its own, straight into its place in the output (a table saved in another
precision, or exported with ``--fp16-tables``, passes through one buffer of its saved
dtype, freed before the next table). Host memory holds the output once, plus one
table at most; the output is written with ``torch.save`` to a temporary name and
renamed, so ``FILE`` is complete or absent (a write that fails, a read-only or full
filesystem, is one line naming ``FILE``, exit 6).

The file loads with::

    model = recpipe.models.build_model(cfg.model, device=torch.device("cpu"))  # or model.factory(cfg)
    model.load_state_dict(torch.load(FILE, weights_only=True))

``--fp16-tables`` stores the embedding tables in float16 (half the bytes; the
dense weights stay as they are); ``load_state_dict`` casts them into an fp32
model's tables, or keep them half with ``model.half()`` for the tables only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recpipe.checkpoint.reader import MODEL_PREFIX, dcp_load, model_tensors, shape_differences
from recpipe.checkpoint.store import resolve_checkpoint
from recpipe.config import ConfigError, RecpipeConfig, load_config
from recpipe.errors import CheckpointError, StorageError, storage_problem
from recpipe.exit_codes import EXIT_OK
from recpipe.models import make_model
from recpipe.serving import export_program

__all__ = ["ExportReport", "export_checkpoint", "main_export", "resolve_checkpoint", "table_keys"]

_GIB = 2**30


@dataclass
class ExportReport:
    checkpoint: Path
    out: Path
    tables: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)  # key -> shape, dtype
    dense: int = 0  # dense tensors
    bytes: int = 0
    program: Path | None = None  # the servable program, with --format program
    program_tables: str = "fp32"
    program_inputs: list[str] = field(default_factory=list)  # the program's arguments, in order

    def lines(self) -> list[str]:
        out = [f"{self.out}: {len(self.tables)} embedding tables and {self.dense} dense tensors from "
               f"{self.checkpoint} ({self.bytes / _GIB:.3f} GiB)"] + [
            f"  {key}: {list(shape)} {str(dtype).removeprefix('torch.')}" for key, (shape, dtype) in self.tables.items()]
        if self.program is not None:
            needs = " after `import fbgemm_gpu`" if self.program_tables in ("int8", "int4") else ""
            out.append(f"{self.program}: torch.export program, {self.program_tables} tables; "
                       f"torch.export.load(path).module()({', '.join(self.program_inputs)}){needs} -> prediction "
                       "(docs/export.md)")
        return out


def table_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the embedding tables of every torchrec embedding module of ``model``."""
    keys = set()
    for path, module in model.named_modules():
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            keys.update(f"{path}.{name}" if path else name for name in module.state_dict())
    return keys


def _target(cfg: RecpipeConfig) -> nn.Module:
    """The unsharded model on meta: its keys, shapes and dtypes are the export's."""
    return make_model(cfg)


def _load(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``tensors`` (checkpoint key -> full tensor) from the checkpoint, in place."""
    with warnings.catch_warnings():  # DCP says it assumes a single process: that is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp_load(tensors, path, no_dist=True)


def export_checkpoint(cfg: RecpipeConfig, checkpoint: str | Path, out: str | Path, *, fp16_tables: bool = False,
                      program: str | Path | None = None, program_tables: str = "fp32") -> ExportReport:
    """Write the unsharded model state of ``checkpoint`` to ``out`` (see the module docstring);
    with ``program``, also the servable ``torch.export`` program of the model with that
    state, its tables as ``program_tables`` says (:func:`recpipe.serving.export_program`)."""
    check_out(Path(out))
    path = resolve_checkpoint(checkpoint)
    model = _target(cfg)
    target, tables = model.state_dict(), table_keys(model)
    stored = model_tensors(path)  # read without running code: a crafted file is refused
    _check_same_model(path, cfg.model.factory, target, stored)
    report = ExportReport(path, Path(out))
    state: dict[str, torch.Tensor] = {}
    dense = {key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype)
             for key in target if key not in tables}
    if dense:
        _load(path, {MODEL_PREFIX + key: t for key, t in dense.items()})
    for key, t in dense.items():
        state[key] = t.to(target[key].dtype)
    report.dense = len(dense)
    for key in (k for k in target if k in tables):  # one read per table
        want = torch.float16 if fp16_tables else target[key].dtype
        buffer = torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype)
        _load(path, {MODEL_PREFIX + key: buffer})
        state[key] = buffer.to(want)
        del buffer
        report.tables[key] = (tuple(state[key].shape), want)
    ordered = {key: state[key] for key in target}  # the model's own order
    report.bytes = sum(t.numel() * t.element_size() for t in ordered.values())
    if program is not None:  # first: a model that cannot be traced leaves neither file
        meta = export_program(cfg, ordered, program, program_tables, metadata={"checkpoint": str(path)})
        report.program, report.program_tables, report.program_inputs = Path(program), program_tables, list(meta["inputs"])
    _save_atomic(ordered, report.out)
    return report


def _check_same_model(path: Path, factory: str | None, target: dict, stored: dict) -> None:
    missing = sorted(set(target) - set(stored))
    unexpected = sorted(set(stored) - set(target))
    shapes = shape_differences(stored, target)
    if not (missing or unexpected or shapes):
        return
    what = "model.factory=" + repr(factory) if factory else "the built-in model"
    problems = ([f"missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else []) + \
        ([f"not in the config's model: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"] if unexpected else []) + shapes
    raise CheckpointError(f"checkpoint {path} does not hold the config's model ({what}): " + "; ".join(problems) +
                          "; export with the config the checkpoint was trained with")


def check_out(out: Path) -> None:
    """Before any work: ``--out`` names a file in a directory that exists (ConfigError,
    exit 2, otherwise: a directory given for the file, or a missing one, is a mistake in
    the arguments, not something to create)."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; name the file to write, e.g. --out {out / 'model.pt'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {out.parent} does not exist; create it first")


def _save_atomic(state: dict[str, torch.Tensor], out: Path) -> None:
    """``torch.save`` through a Python file (whose failed write carries its errno: a full
    disk, a read-only or pseudo filesystem) to a temporary name, then renamed to ``out``."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
        os.replace(tmp, out)
    except BaseException as err:
        with contextlib.suppress(OSError):  # fails too on a read-only filesystem: the write's error is what to say
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise StorageError(f"cannot write --out {out}: {storage_problem(err, out.parent)}") from None
        raise


def main_export(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.tables != "fp32" and args.format != "program":
        raise ConfigError(f"--tables {args.tables} sets the tables of the program: add --format program")
    program = Path(args.out).with_suffix(".pt2") if args.format == "program" else None
    if program is not None and program == Path(args.out):
        raise ConfigError(f"--out {args.out}: the program goes beside the state dict as {program}; name the state "
                          "dict FILE.pt")
    report = export_checkpoint(cfg, args.checkpoint, args.out, fp16_tables=args.fp16_tables, program=program,
                               program_tables=args.tables)
    print("\n".join(report.lines()))
    return EXIT_OK
