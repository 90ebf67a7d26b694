"""How long ``recpipe train`` takes from the command to its first timed step, phase by phase.

A :class:`StartupClock` is made where the command starts (``recpipe.train.cli``), counting
from the moment the process was created (``/proc/self/stat``: the interpreter's start and
the imports are a phase of their own), and travels with the job: from the launcher to each
rank (an argument of the launch; wall-clock times, so the same clock on both sides), then
through the rank's set-up and its first steps (:class:`~recpipe.train.trainer.Trainer`).
Each ``lap(name)`` adds the time since the previous lap to the phase ``name``.

The phases, in order (a phase that did not happen is absent):

* ``imports``: process start to the command's first line (Python, torch, the config's
  libraries; the launcher never imports the trainer: its ranks' server does, during ``launch``);
* ``config``: the YAML read and validated; ``preflight``: the pre-launch checks (the model's
  tables checked on meta: torchrec, FBGEMM) and the memory plan; ``launch``: the ranks started (``recpipe train``'s own launcher);
* ``process_group``: the rendezvous; ``checkpoint_choice``: the checkpoint to resume from
  chosen (verified, model-free); ``data_start``: the training batches' producers started,
  so they make the first batches while the model is built;
* ``model``: the model built and sharded (its tables allocated and initialized);
  ``checkpoint_load``: the chosen checkpoint loaded into it; ``pipeline``: the pipeline
  and its speed features; ``run_setup``: metrics, evaluation, run directory, fault handling;
* ``first_batch``: what the first step waited for its first batch; ``first_step``: the rest
  of the first step (lazy initialization, ``pipeline.compile``'s compile); ``warm_up``: the
  steps until every speed feature is ready (``pipeline.step_graph``'s and
  ``pipeline.cuda_graphs``' capture); ``segment_ends``: evaluations and checkpoints that came
  before the first timed step (``train.eval_every`` or ``checkpoint.every`` shorter than the
  warm-up).

The first timed step is the step after those: the first one that runs as the rest of the
run does. ``summary()`` goes into summary.json (``startup``) and ``line()`` into the log.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from recpipe.compat import torch as compat_torch

__all__ = ["StartupClock", "compile_cache_counts", "process_start_time"]


def process_start_time() -> float:
    """When this process was created (``time.time()`` scale; Linux: its start in ticks since
    boot, ``/proc/self/stat`` field 22, plus the boot time, ``/proc/stat`` ``btime``); elsewhere
    now."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 is the 20th after the name
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def compile_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache: hits and misses in this process so far
    (torch's ``counters``), without importing the compiler where nothing was compiled."""
    counters = compat_torch.dynamo_counters(if_loaded=True)
    if counters is None:
        return {}
    found = {f"fx_graph_{k.removeprefix('fxgraph_cache_')}": v for k, v in counters["inductor"].items()
             if k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
    found |= {f"aot_autograd_{k.removeprefix('autograd_cache_')}": v for k, v in counters["aot_autograd"].items()
              if k in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    return found


@dataclass
class StartupClock:
    """Phases of the start-up (see the module docstring); picklable, so a launcher hands it to its ranks."""

    started_at: float = field(default_factory=process_start_time)
    phases: dict[str, float] = field(default_factory=dict)  # name -> seconds, in the order they ran
    first_timed_step: int | None = None
    to_first_timed_step_s: float | None = None
    _last: float | None = None

    def lap(self, name: str) -> float:
        """Add the time since the previous lap (or the start) to phase ``name``; returns it."""
        now = time.time()
        seconds = now - (self.started_at if self._last is None else self._last)
        self._last = now
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        return seconds

    def move(self, seconds: float, source: str, target: str) -> None:
        """Count ``seconds`` of phase ``source`` as phase ``target`` instead (a wait measured inside it)."""
        self.phases[source] = self.phases.get(source, 0.0) - seconds
        self.phases[target] = self.phases.get(target, 0.0) + seconds

    def done(self, first_timed_step: int) -> None:
        """The start-up ends here: the next step, ``first_timed_step``, runs as the rest of the run."""
        self.first_timed_step = first_timed_step
        self.to_first_timed_step_s = (time.time() if self._last is None else self._last) - self.started_at

    @property
    def finished(self) -> bool:
        return self.first_timed_step is not None

    def summary(self) -> dict[str, Any]:
        return {
            "to_first_timed_step_s": None if self.to_first_timed_step_s is None else round(self.to_first_timed_step_s, 3),
            "first_timed_step": self.first_timed_step,
            "phases_s": {name: round(seconds, 3) for name, seconds in self.phases.items()},
            "compile_cache": compile_cache_counts(),
        }

    def line(self) -> str:
        phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases.items())
        total = "" if self.to_first_timed_step_s is None else f"{self.to_first_timed_step_s:.1f} s "
        return f"start-up: {total}to the first timed step (step {self.first_timed_step}): {phases} (s)"
