"""Exact, resumable checkpoints with torch.distributed.checkpoint (DCP).

One checkpoint is ``checkpoint.dir/step_{step:08d}/``:

* DCP files (``*.distcp``, ``.metadata``): the DistributedModelParallel state_dict
  (sharded tables as ShardedTensors, dense weights) under ``model`` and the
  CombinedOptimizer state (the fused embedding optimizer's sharded states, e.g.
  row-wise Adagrad momentum, and the dense optimizer's) under ``optimizer``. Each
  rank writes only its own shards; DCP writes replicated dense tensors once.
* ``rng_rank{r:05d}.pt``: rank ``r``'s torch CPU (and CUDA) RNG states.
* ``.recpipe_checkpoint``: written by rank 0 before anything else: recpipe started
  this save.
* ``metadata.json``: the data position, the settings a resume must share
  (:func:`resume_settings`) and every other file's size and CRC-32
  (``recpipe.checkpoint.integrity``), written last, by rank 0, after every rank has
  finished writing. A directory without it is incomplete (a crash mid-save) and
  ignored.

A checkpoint is read as data, never run: ``recpipe.checkpoint.reader`` reads
DCP's ``.metadata`` and every other pickle without running code, and refuses a file
that names anything else (exit 6).

Resuming verifies the newest complete checkpoint before loading it; a damaged one
(a truncated shard, a changed byte) is skipped with a warning naming it and the
file, and the next older one is tried. After each save rank 0 keeps the newest
``checkpoint.keep`` intact checkpoints and deletes every other ``step_*`` directory
(older, damaged, or incomplete) that recpipe wrote: a damaged checkpoint never displaces an
intact one. Only what a save wrote is deleted (``recpipe.checkpoint.integrity``: a directory named
as a save names it, holding the marker or its record; in it, the files a save writes): a
user's ``step_notes/``, or a file of theirs in a checkpoint directory, stays. A save that
fails on any rank (read-only directory, full disk) fails on every rank with one error naming
the path; it never writes ``metadata.json``, so the previous checkpoint stays the newest
complete one.

The trainer saves only with the pipeline drained (no batch in flight), so a
checkpoint is exactly the state after ``step`` steps and resuming from it trains
bit for bit like a run that never stopped (tests/test_checkpoint.py).

``checkpoint.dir`` must be one filesystem that every rank sees (an NFS or similar
mount when the job spans machines): rank 0 chooses the checkpoint to resume from
and writes ``metadata.json``; all ranks read and write the DCP files there.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from recpipe.checkpoint.integrity import (CONVERTED_FROM, MARKER_FILE, METADATA_FILE, SAVED_FILES, checkpoint_dirs,
                                          file_records, position_problems, record_problems, verify_checkpoint,
                                          written_by_recpipe)
from recpipe.checkpoint.reader import (UnsafeCheckpointError, dcp_load, model_tensors, read_metadata,
                                       safe_torch_load, shape_differences)
from recpipe.config import CheckpointConfig, ConfigError, RecpipeConfig
from recpipe.errors import CheckpointError, storage_problem

if TYPE_CHECKING:
    from torchrec.optim.keyed import CombinedOptimizer

__all__ = [
    "FORMAT_VERSION",
    "ChosenCheckpoint",
    "TrainPosition",
    "check_checkpoint_config",
    "check_resume",
    "check_resume_shapes",
    "choose_checkpoint",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "load_chosen",
    "resolve_checkpoint",
    "resume_settings",
    "save_checkpoint",
]

FORMAT_VERSION = 2  # 2: "files" holds every file's size and CRC-32


@dataclass(frozen=True)
class TrainPosition:
    """Where training stands; the same on every rank."""

    step: int  # steps trained in total
    epoch: int  # epoch the next batch comes from
    batch: int  # batches of ``epoch`` already trained: the data loader's start_batch


def checkpoint_path(cfg: CheckpointConfig, step: int) -> Path:
    assert cfg.dir is not None, "checkpointing is off (checkpoint.dir is null)"
    return Path(cfg.dir) / f"step_{step:08d}"


def _rng_file(path: Path, rank: int) -> Path:
    return path / f"rng_rank{rank:05d}.pt"


def complete_checkpoints(directory: str | Path, warn: bool = True) -> list[Path]:
    """Every complete checkpoint under ``directory`` (a checkpoint directory with its
    ``metadata.json``), oldest first; with ``warn``, a warning for every one that a save
    started (its marker) and never finished."""
    complete = []
    for path in checkpoint_dirs(directory):
        if (path / METADATA_FILE).is_file():
            complete.append(path)
        elif warn and (path / MARKER_FILE).is_file():
            warnings.warn(f"ignoring incomplete checkpoint {path} (no {METADATA_FILE}: the save was interrupted)")
    return complete


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (warns about incomplete ones)."""
    complete = complete_checkpoints(directory)
    return complete[-1] if complete else None



def resolve_checkpoint(path: str | Path, what: str = "--checkpoint") -> Path:
    """``path`` if it is one complete checkpoint (``step_*`` with its metadata), else
    the newest complete one in the ``checkpoint.dir`` ``path``; its files verified.
    ``what``: the argument that named ``path``, for messages."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{what} {root}: no such directory")
    chosen = root if (root / METADATA_FILE).is_file() else latest_checkpoint(root)
    if chosen is None:
        raise CheckpointError(f"{what} {root}: no complete checkpoint in it (a checkpoint.dir holds step_* "
                              f"directories, each complete once it has {METADATA_FILE})")
    problems = verify_checkpoint(chosen)
    if problems:
        raise CheckpointError(f"checkpoint {chosen} is damaged: {'; '.join(problems)}")
    return chosen

def describe_newest(directory: str | None) -> str:
    """"newest checkpoint: PATH", or why there is none, for messages."""
    if directory is None:
        return "no checkpoint (checkpoint.dir is null)"
    complete = complete_checkpoints(directory, warn=False)
    return f"newest checkpoint: {complete[-1]}" if complete else f"no checkpoint in {directory} yet"


def check_checkpoint_config(cfg: CheckpointConfig) -> None:
    """Before any process starts: warn about ``every`` without a ``dir``, and refuse
    a fresh run (``resume=false``) into a directory that holds another run's
    checkpoints, whose higher steps would outlive the new ones when pruning."""
    if cfg.dir is None:
        if cfg.every:
            warnings.warn(f"checkpoint.every={cfg.every} is ignored: checkpoint.dir is null (checkpointing is off)")
        if "on_preempt" in cfg.model_fields_set and cfg.on_preempt:
            warnings.warn("checkpoint.on_preempt=true is ignored: checkpoint.dir is null (checkpointing is off)")
        return
    latest = None if cfg.resume else latest_checkpoint(cfg.dir)
    if latest is not None:
        raise ConfigError(
            f"checkpoint.resume=false but checkpoint.dir={cfg.dir!r} already holds checkpoints (newest: "
            f"{latest.name}); delete them, choose another checkpoint.dir, or set checkpoint.resume=true"
        )


def _dcp_state(model: nn.Module, optimizer_state: dict) -> dict:
    """What DCP saves and loads in place. DCP stores nothing for an empty dict and
    then misses its key on load, so parameters whose optimizer keeps no state (SGD)
    are left out; the per-parameter dicts are shared with ``optimizer_state``, so
    loading into this view fills ``optimizer_state``."""
    state = {"model": model.state_dict()}
    stateful = {key: param_state for key, param_state in optimizer_state["state"].items() if param_state}
    if stateful:
        state["optimizer"] = stateful
    return state


def resume_settings(cfg: RecpipeConfig) -> dict[str, Any]:
    """What a run that resumes from a checkpoint must share with the run that saved it,
    recorded in ``metadata.json``: the number of ranks (a rank's data position, RNG state
    and shards are its own: with another number the run does not continue, and not bit
    for bit), the optimizers (their state is what the checkpoint holds: another one
    would start from none, or not load) and the model settings that decide the shapes of
    its tensors (another table size, ``embedding_dim`` or architecture would not load).
    A ``model.factory`` model's shapes are its code's: :func:`check_resume_shapes` compares them."""
    m = cfg.model
    shapes = ["arch", "embedding_dim", "num_dense_features", "num_embeddings_per_feature", "dense_arch_layer_sizes",
              "over_arch_layer_sizes"] + (["dcn_num_layers", "dcn_low_rank_dim"] if m.arch == "dcnv2" else [])
    model = {f"model.{name}": getattr(m, name) for name in shapes} if m.factory is None else {}
    return {"distributed.nproc": cfg.distributed.nproc, "optimizer.embedding.name": cfg.optimizer.embedding.name,
            "optimizer.dense.name": cfg.optimizer.dense.name, "model.factory": m.factory, **model}


def _resume_candidate(ckpt: CheckpointConfig) -> tuple[Path, dict] | None:
    """The newest complete checkpoint in ``checkpoint.dir`` and its record, when the run
    resumes and it has a record a resume reads (else the ranks find it damaged)."""
    if ckpt.dir is None or not ckpt.resume:
        return None
    complete = complete_checkpoints(ckpt.dir, warn=False)
    if not complete:
        return None
    try:
        meta = json.loads((complete[-1] / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    if record_problems(meta) or position_problems(meta):
        return None
    return complete[-1], meta


def check_resume(cfg: RecpipeConfig) -> None:
    """Before any process starts: the newest complete checkpoint in ``checkpoint.dir``
    (the one a resume starts from, unless it turns out damaged) was saved with this run's
    :func:`resume_settings`; else a ConfigError (exit 2) naming each that differs. A
    record from before the settings were recorded has its number of ranks."""
    found = _resume_candidate(cfg.checkpoint)
    if found is None:
        return
    path, meta = found
    # A converted checkpoint (recpipe.checkpoint.convert) holds nothing of a number of ranks.
    ranks = {} if meta.get(CONVERTED_FROM) else {"distributed.nproc": meta["world_size"]}
    saved = meta.get("settings") or ranks
    now = resume_settings(cfg)
    differ = [f"{key}={saved[key]!r} (this run: {now[key]!r})" for key in now if key in saved and saved[key] != now[key]]
    if differ:
        raise ConfigError(
            f"checkpoint.resume: {path} was saved with {', '.join(differ)}; a resumed run continues the saved "
            "one with the same settings: set them back, or start anew in another checkpoint.dir"
        )


def check_resume_shapes(ckpt: CheckpointConfig, model: nn.Module) -> None:
    """Before any process starts, after :func:`check_resume`: every tensor of ``model``
    (the config's, built on meta) has its shape in the checkpoint a resume starts from,
    read from DCP's ``.metadata`` without running code; else a ConfigError (exit 2) naming
    each that differs (a ``model.factory`` model whose code or ``model.options`` changed).
    A ``.metadata`` that names anything but DCP's classes is refused here (exit 6)."""
    found = _resume_candidate(ckpt)
    if found is None:
        return
    path = found[0]
    try:
        stored = model_tensors(path)
    except UnsafeCheckpointError:
        raise
    except CheckpointError:
        return  # damaged: the ranks find it so and skip it
    differ = shape_differences(stored, model.state_dict())
    if differ:
        raise ConfigError(
            f"checkpoint.resume: {path} holds another model than this run's ({'; '.join(differ[:5])}"
            f"{' ...' if len(differ) > 5 else ''}); a resumed run continues the saved one with the same model: set "
            "its settings back, or start anew in another checkpoint.dir"
        )


def save_checkpoint(cfg: CheckpointConfig, model: nn.Module, optimizer: CombinedOptimizer, position: TrainPosition,
                    settings: dict[str, Any] | None = None) -> Path:
    """Collective: every rank calls it at the same step, with no batch in flight.
    ``settings``: :func:`resume_settings`, recorded for the check of a resume.
    Raises :class:`CheckpointError` on every rank when any rank cannot write."""
    path = checkpoint_path(cfg, position.step)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _agreed(cfg, path, lambda: _start_save(path, position.step) if rank == 0 else None)
    _agreed(cfg, path, lambda: _write_rng(path, rank))
    try:
        # dcp.save returns on every rank only after rank 0 wrote DCP's own .metadata,
        # i.e. after all ranks' shards are on disk; a failure on any rank raises on all.
        dcp.save(_dcp_state(model, optimizer.state_dict()), checkpoint_id=str(path))
    except CheckpointException as err:
        failed_rank, (exc, _) = min(err.failures.items())
        raise _save_error(cfg, path, f"rank {failed_rank}: {storage_problem(exc, path)}") from None
    records: list[dict | None] = [None] * world_size
    dist.all_gather_object(records, file_records(path, rank, world_size))
    files = {name: record for part in records for name, record in (part or {}).items()}
    meta = {"format": FORMAT_VERSION, "world_size": world_size, **asdict(position), "files": files,
            **({"settings": settings} if settings else {})}
    _agreed(cfg, path, lambda: _write_metadata(path, meta) if rank == 0 else None)
    if rank == 0:
        _prune(Path(cfg.dir), keep=cfg.keep)
    dist.barrier()
    return path


def _start_save(path: Path, step: int) -> None:
    """Rank 0, first: the directory of the checkpoint of ``step`` with the marker that says
    recpipe started writing it. Leftovers of an interrupted save at this step (the run
    resumed from an older checkpoint) go first: stale shard files must not mix with the new ones."""
    if path.exists():
        _delete_saved(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER_FILE).write_text(f"recpipe checkpoint of step {step}: {METADATA_FILE} is written last, once it is "
                                    "complete\n")


def _delete_saved(path: Path) -> list[str]:
    """Delete what a save wrote in checkpoint directory ``path`` (the names ``SAVED_FILES``
    matches), and the directory once empty; returns the names of what else it holds, kept."""
    for file in path.iterdir():
        if SAVED_FILES.fullmatch(file.name) and file.is_file():
            file.unlink()
    others = sorted(p.name for p in path.iterdir())
    if not others:
        path.rmdir()
    return others


def _write_rng(path: Path, rank: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Serialized in memory, written with Python's file I/O: torch.save's own writer
    # reports a short write on a full disk without its errno.
    buffer = io.BytesIO()
    torch.save(_rng_states(), buffer)
    _rng_file(path, rank).write_bytes(buffer.getbuffer())


def _write_metadata(path: Path, meta: dict) -> None:
    tmp = path / (METADATA_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(path / METADATA_FILE)  # atomic: a reader sees all of it or nothing


def _agreed(cfg: CheckpointConfig, path: Path, action: Callable[[], object]) -> None:
    """Collective: run this rank's part of a save step; if it fails on any rank
    (read-only directory, full disk), every rank raises the same CheckpointError."""
    try:
        action()
        problem = None
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        problem = f"rank {dist.get_rank()}: {storage_problem(err, path)}{where}"
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    failed = [p for p in problems if p]
    if failed:
        raise _save_error(cfg, path, failed[0])


def _save_error(cfg: CheckpointConfig, path: Path, reason: str) -> CheckpointError:
    earlier = [p for p in complete_checkpoints(cfg.dir, warn=False) if p != path]
    still = f"the newest complete checkpoint is still {earlier[-1]}" if earlier else "no earlier checkpoint exists"
    return CheckpointError(f"cannot save checkpoint {path} ({reason}); {still}")


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` intact checkpoints; delete every other checkpoint that recpipe
    wrote (``written_by_recpipe``): older checkpoints, damaged ones, and incomplete ones
    (interrupted saves: no save is under way now, and the new checkpoint is complete). A
    complete checkpoint counts as intact unless resuming found it damaged (``_FOUND_DAMAGED``)
    or one of its files is not the size it was saved with (a ``stat`` each, no read): a
    damaged checkpoint never takes the place of an intact one. Only the files a save writes
    are deleted, and a directory only once empty. Housekeeping: a failure only warns."""
    steps = [p for p in checkpoint_dirs(root) if written_by_recpipe(p)]
    intact = [p for p in steps if (p / METADATA_FILE).is_file() and p not in _FOUND_DAMAGED
              and not verify_checkpoint(p, checksums=False)]
    kept = set(intact[-keep:])
    for path in steps:
        if path in kept:
            continue
        try:
            others = _delete_saved(path)
        except OSError as err:
            warnings.warn(f"checkpoint.keep={keep}: cannot delete the checkpoint {path}: {err}")
            continue
        if others:
            listed = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
            warnings.warn(f"checkpoint.keep={keep}: deleted the checkpoint in {path} but kept the directory: it also "
                          f"holds {listed}, which recpipe did not write")
        _FOUND_DAMAGED.discard(path)


# Checkpoints that resuming found damaged, in this process (rank 0's): retention does not
# count them as kept. Their damage may be a changed byte, which only a checksum finds.
_FOUND_DAMAGED: set[Path] = set()


def load_checkpoint(cfg: CheckpointConfig, model: nn.Module, optimizer: CombinedOptimizer) -> TrainPosition | None:
    """Collective: restore the newest intact checkpoint in ``cfg.dir`` into ``model``
    and ``optimizer`` (already built and sharded) and this rank's RNG; returns its
    position, or None when there is none to resume from."""
    chosen = choose_checkpoint(cfg)
    if chosen is None:
        return None
    load_chosen(chosen, model, optimizer)
    return chosen.position


@dataclass(frozen=True)
class ChosenCheckpoint:
    """The checkpoint a resume loads (:func:`choose_checkpoint`): its directory and position."""

    path: Path
    position: TrainPosition


def choose_checkpoint(cfg: CheckpointConfig) -> ChosenCheckpoint | None:
    """Collective: the newest intact checkpoint in ``cfg.dir`` (verified; the damaged ones
    are skipped with a warning), or None when there is none. Needs no model: the trainer
    knows where its data resumes before it builds the model."""
    path = _choose_intact(cfg)
    if path is None:
        return None
    meta = json.loads((path / METADATA_FILE).read_text())
    return ChosenCheckpoint(path, TrainPosition(step=meta["step"], epoch=meta["epoch"], batch=meta["batch"]))


def load_chosen(chosen: ChosenCheckpoint, model: nn.Module, optimizer: CombinedOptimizer) -> None:
    """Collective: load ``chosen`` into ``model`` and ``optimizer`` (built and sharded) and
    this rank's RNG."""
    path = chosen.path
    meta = json.loads((path / METADATA_FILE).read_text())
    _init_lazy_optimizer_state(optimizer)
    # DCP loads in place into tensors of the right (sharded) shapes: take the live
    # state_dicts, fill them, then hand them back (the fused optimizer's states are
    # views of the FBGEMM buffers; load_state_dict copies where they are not).
    optimizer_state = optimizer.state_dict()
    state = _dcp_state(model, optimizer_state)
    dcp_load(state, path)  # CheckpointError on every rank
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(optimizer_state)
    if not meta.get(CONVERTED_FROM):  # a converted checkpoint has no RNG state: each rank keeps its seeded RNG
        _restore_rng(path, saved_world_size=meta["world_size"])


def _choose_intact(cfg: CheckpointConfig) -> Path | None:
    """Collective: the newest complete checkpoint that passes verification (rank 0
    lists them; every rank checks its share of each); warns about each damaged one. One
    whose DCP metadata names anything but DCP's classes is refused on every rank
    (:class:`UnsafeCheckpointError`): it was made to run code, not damaged."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    listed = [complete_checkpoints(cfg.dir)[::-1] if rank == 0 else None]
    dist.broadcast_object_list(listed, src=0)  # every rank resumes from rank 0's choice
    damaged = []
    for path in listed[0]:
        found: list[tuple[list[str] | None, str | None] | None] = [None] * world_size
        dist.all_gather_object(found, _resumable_problems(path, rank, world_size))
        refused = [refusal for _, refusal in found if refusal]
        if refused:
            raise UnsafeCheckpointError(refused[0])
        if found[0][0] is None:  # no record: format 1
            if rank == 0:
                warnings.warn(f"checkpoint {path} has no checksums (saved by an older recpipe); loading it unverified")
            return path
        problems = sorted({p for part, _ in found for p in part or ()})
        if not problems:
            return path
        damaged.append(f"{path.name}: {'; '.join(problems)}")
        _FOUND_DAMAGED.add(path)
        if rank == 0:
            warnings.warn(f"skipping damaged checkpoint {path}: {'; '.join(problems)}; trying the previous one")
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in checkpoint.dir={cfg.dir!r}: {' | '.join(damaged)}. Move the damaged "
            "checkpoints away to start from step 0, or restore them from a copy"
        )
    return None


def _resumable_problems(path: Path, rank: int, world_size: int) -> tuple[list[str] | None, str | None]:
    """``verify_checkpoint``'s problems of ``path`` (None for an unverifiable, format 1,
    record) and why it is refused (or None). Rank 0 also checks what a resume reads: the
    record's training position, and DCP's metadata, read without running code."""
    problems = verify_checkpoint(path, rank, world_size)
    if rank != 0:
        return problems, None
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return problems, None  # which say so
    if isinstance(meta, dict) and (position := position_problems(meta)):
        return [*(problems or []), *position], None
    if problems:
        return problems, None
    try:
        read_metadata(path)
    except UnsafeCheckpointError as err:
        return problems, str(err)
    except CheckpointError as err:
        return [str(err)], None
    return problems, None


def _init_lazy_optimizer_state(optimizer: CombinedOptimizer) -> None:
    """torch.optim optimizers such as Adam create their state at the first step, so a
    fresh one has nothing for DCP to load into. A dummy step with zero gradients
    creates it (the model's parameters are overwritten by the load right after).
    Fused embedding optimizers hold their state in the kernel from construction."""
    from torchrec.optim.fused import FusedOptimizer  # here: the launcher imports this module, not torchrec

    for _, opt in optimizer.optimizers:
        if not isinstance(opt, FusedOptimizer) and not opt.state:
            opt.init_state()
            opt.zero_grad(set_to_none=True)


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _restore_rng(path: Path, saved_world_size: int) -> None:
    rank = dist.get_rank()
    file = _rng_file(path, rank)
    if not file.is_file():
        warnings.warn(
            f"{path} was saved by {saved_world_size} ranks and has no RNG state for rank {rank}; "
            "this rank keeps its seeded RNG"
        )
        return
    try:
        states = safe_torch_load(file, file)
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(str(err), every_rank=False) from None  # this rank's own file
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
