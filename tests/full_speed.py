"""Training fed at full speed against the same training fed slowly (tests/test_full_speed.py
and its GPU twin, tests/test_full_speed_gpu.py).

:func:`train` runs :class:`~recpipe.train.trainer.Trainer` on one rank in this process and
keeps every step's loss (a device tensor, read at the end: no host sync per step), the final
eval metrics and how often the host waited for the device (``Pipeline.host_waits``). With
``lockstep`` the host waits for the device after every step, so no batch's memory can be
touched by a later batch's work before its step is done: the reference a run at full speed
(producer processes keeping up, the host ``pipeline.steps_ahead`` steps ahead of the device)
must equal bit for bit.

:func:`train_resumed` is the same run in two commands, the second resuming from the
checkpoint the first saved at ``split``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from recpipe.bench.runner import single_rank_group
from recpipe.config import RecpipeConfig, load_config
from recpipe.distributed import init_process_group, launch_local, shutdown_process_group
from recpipe.train.trainer import Trainer


@dataclass
class Trained:
    losses: torch.Tensor  # one per step, on the host
    eval: dict[str, float]
    host_waits: int | None
    steps: int


def config(base: list[str], run: Path, overrides: list[str]) -> RecpipeConfig:
    return load_config(None, [*base, f"logging.run_dir={run / 'logs'}", f"checkpoint.dir={run / 'ckpt'}",
                              "train.progress=false", "train.eval_every=0", *overrides])


def train(cfg: RecpipeConfig, lockstep: bool = False) -> Trained:
    """Train ``cfg``: one rank in this process, several in ``launch_local``'s (rank 0's result)."""
    if cfg.distributed.nproc == 1:
        with single_rank_group():
            return _fit(cfg, init_process_group(cfg), lockstep)
    out = Path(cfg.logging.run_dir) / "rank0_trained.pt"
    launch_local(_rank, cfg.distributed.nproc, cfg, lockstep, str(out))
    return Trained(**torch.load(out))


def _rank(cfg: RecpipeConfig, lockstep: bool, out: str) -> None:
    device = init_process_group(cfg)
    try:
        trained = _fit(cfg, device, lockstep)
        if dist.get_rank() == 0:
            torch.save(vars(trained), out)
    finally:
        shutdown_process_group()


def _fit(cfg: RecpipeConfig, device: torch.device, lockstep: bool) -> Trained:
    trainer = Trainer(cfg, device)
    losses: list[torch.Tensor] = []
    after_step, progress = trainer._after_step, trainer.pipeline.progress

    def keep_loss(loss: torch.Tensor) -> None:
        losses.append(loss.detach().clone())
        after_step(loss)

    def step_in_lockstep(batches):
        output = progress(batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return output

    trainer._after_step = keep_loss
    if lockstep:
        trainer.pipeline.progress = step_in_lockstep
    trainer.fit()
    return Trained(torch.stack(losses).cpu(), dict(trainer.last_eval), trainer.pipeline.host_waits,
                   trainer.position.step)


def train_resumed(base: list[str], run: Path, overrides: list[str], steps: int, split: int) -> Trained:
    """``steps`` steps in two runs: the first stops at ``split`` (a checkpoint), the second resumes."""
    first = train(config(base, run, [*overrides, f"train.steps={split}"]))
    second = train(config(base, run, [*overrides, f"train.steps={steps}"]))
    assert first.steps == split and second.steps == steps
    return Trained(torch.cat([first.losses, second.losses]), second.eval, second.host_waits, steps)


def differences(fast: Trained, slow: Trained) -> list[str]:
    """What differs, bit for bit: steps whose losses differ, eval metrics that differ."""
    out = []
    if fast.losses.shape != slow.losses.shape:
        return [f"{len(fast.losses)} vs {len(slow.losses)} steps"]
    steps = (fast.losses != slow.losses).nonzero().flatten().tolist()
    if steps:
        first = steps[0]
        out.append(f"losses of {len(steps)} steps differ, first step {first + 1}: "
                   f"{fast.losses[first].item()!r} vs {slow.losses[first].item()!r}")
    out += [f"eval {k}: {fast.eval[k]!r} vs {slow.eval.get(k)!r}" for k in fast.eval if fast.eval[k] != slow.eval.get(k)]
    return out
