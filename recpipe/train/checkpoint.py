"""Exact, resumable checkpoints with torch.distributed.checkpoint (DCP).

One checkpoint is ``checkpoint.dir/step_{step:08d}/``:

* DCP files (``*.distcp``, ``.metadata``): the DistributedModelParallel state_dict
  (sharded tables as ShardedTensors, dense weights) under ``model`` and the
  CombinedOptimizer state (the fused embedding optimizer's sharded states, e.g.
  row-wise Adagrad momentum, and the dense optimizer's) under ``optimizer``. Each
  rank writes only its own shards; DCP writes replicated dense tensors once.
* ``rng_rank{r:05d}.pt``: rank ``r``'s torch CPU (and CUDA) RNG states.
* ``metadata.json``: the data position, written last, by rank 0, after every rank
  has finished writing. A directory without it is incomplete (a crash mid-save)
  and ignored.

The trainer saves only with the pipeline drained (no batch in flight), so a
checkpoint is exactly the state after ``step`` steps and resuming from it trains
bit for bit like a run that never stopped (tests/test_checkpoint.py).

``checkpoint.dir`` must be one filesystem that every rank sees (an NFS or similar
mount when the job spans machines): rank 0 chooses the checkpoint to resume from
and writes ``metadata.json``; all ranks read and write the DCP files there.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.optim.fused import FusedOptimizer
from torchrec.optim.keyed import CombinedOptimizer

from recpipe.config import CheckpointConfig, ConfigError

__all__ = ["TrainPosition", "check_checkpoint_config", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

METADATA_FILE = "metadata.json"
_FORMAT_VERSION = 1


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


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``; warns about every
    ``step_*`` directory that lacks ``metadata.json`` (an interrupted save)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    complete = []
    for path in sorted(root.glob("step_*")):
        if (path / METADATA_FILE).is_file():
            complete.append(path)
        else:
            warnings.warn(f"ignoring incomplete checkpoint {path} (no {METADATA_FILE}: the save was interrupted)")
    return complete[-1] if complete else None


def check_checkpoint_config(cfg: CheckpointConfig) -> None:
    """Before any process starts: warn about ``every`` without a ``dir``, and refuse
    a fresh run (``resume=false``) into a directory that holds another run's
    checkpoints, whose higher steps would outlive the new ones when pruning."""
    if cfg.dir is None:
        if cfg.every:
            warnings.warn(f"checkpoint.every={cfg.every} is ignored: checkpoint.dir is null (checkpointing is off)")
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


def save_checkpoint(cfg: CheckpointConfig, model: nn.Module, optimizer: CombinedOptimizer, position: TrainPosition) -> Path:
    """Collective: every rank calls it at the same step, with no batch in flight."""
    path = checkpoint_path(cfg, position.step)
    rank = dist.get_rank()
    if rank == 0 and path.exists():
        # Leftovers of an interrupted save at this step (the run resumed from an
        # older checkpoint): stale shard files must not mix with the new ones.
        shutil.rmtree(path)
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_states(), _rng_file(path, rank))
    # dcp.save returns on every rank only after rank 0 wrote DCP's own .metadata,
    # i.e. after all ranks' shards are on disk.
    dcp.save(_dcp_state(model, optimizer.state_dict()), checkpoint_id=str(path))
    if rank == 0:
        meta = {"format": _FORMAT_VERSION, "world_size": dist.get_world_size(), **asdict(position)}
        tmp = path / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.rename(path / METADATA_FILE)  # atomic: a reader sees all of it or nothing
        _prune(Path(cfg.dir), keep=cfg.keep)
    dist.barrier()
    return path


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than them."""
    steps = sorted(root.glob("step_*"))
    complete = [p for p in steps if (p / METADATA_FILE).is_file()]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for path in steps:
        if path < oldest_kept:
            shutil.rmtree(path)


def load_checkpoint(cfg: CheckpointConfig, model: nn.Module, optimizer: CombinedOptimizer) -> TrainPosition | None:
    """Collective: restore the newest complete checkpoint in ``cfg.dir`` into
    ``model`` and ``optimizer`` (already built and sharded) and this rank's RNG;
    returns its position, or None when there is none to resume from."""
    choice = [latest_checkpoint(cfg.dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)  # every rank resumes from rank 0's choice
    path = choice[0]
    if path is None:
        return None
    meta = json.loads((path / METADATA_FILE).read_text())
    _init_lazy_optimizer_state(optimizer)
    # DCP loads in place into tensors of the right (sharded) shapes: take the live
    # state_dicts, fill them, then hand them back (the fused optimizer's states are
    # views of the FBGEMM buffers; load_state_dict copies where they are not).
    optimizer_state = optimizer.state_dict()
    state = _dcp_state(model, optimizer_state)
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(optimizer_state)
    _restore_rng(path, saved_world_size=meta["world_size"])
    return TrainPosition(step=meta["step"], epoch=meta["epoch"], batch=meta["batch"])


def _init_lazy_optimizer_state(optimizer: CombinedOptimizer) -> None:
    """torch.optim optimizers such as Adam create their state at the first step, so a
    fresh one has nothing for DCP to load into. A dummy step with zero gradients
    creates it (the model's parameters are overwritten by the load right after).
    Fused embedding optimizers hold their state in the kernel from construction."""
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
    states = torch.load(file, weights_only=True)
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
