"""Every check of a config before launch, in one place: :func:`preflight`.

``load_config`` (``recpipe.config``) validates the config itself: types, allowed values
and the rules between its own fields. What depends on more than the config is checked
here, above it, before any process starts:

1. the rules of the pipeline and of the speed features it enables
   (:func:`check_rules`: ``PipelineDef.check``, ``SpeedupDef.check``, and each enabled
   feature against the capabilities the pipeline offers);
2. the machine (:func:`check_machine`: a CUDA GPU for what needs one, FBGEMM's CPU
   kernels, the distributed backend, optional packages);
3. ``checkpoint.dir`` (another run's checkpoints), the data's files, the model's tables
   against ``sharding.*``, and ``pipeline.class``;
4. on CUDA, the memory plan against the GPU's memory (:func:`check_memory`: exit 3,
   with the cheapest changes that make it fit).

Every problem of 1-3 is a ``ConfigError`` naming its key (exit 2), or a ``DataError`` (exit 5).
``recpipe plan`` and the bench run :func:`check_rules` (the machine there is not the
one that trains); ``recpipe train`` and :func:`recpipe.train.train` run all of it. This
module imports nothing heavy: the checks of steps 3 and 4 import what they check (the
data readers, torchrec, the user's class, the planner) when they run.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

from recpipe.capabilities import CAPABILITIES
from recpipe.config import PLANNER_ON_CPU, RecpipeConfig
from recpipe.errors import ConfigError
from recpipe.exit_codes import EXIT_DOES_NOT_FIT
from recpipe.pipelines.registry import PIPELINES, offering
from recpipe.speedups.registry import SPEEDUPS

__all__ = ["Machine", "check_machine", "check_memory", "check_rules", "preflight", "rule_problems"]


@dataclass(frozen=True)
class Machine:
    """What the checks need to know of the machine that launches the run."""

    cuda: bool  # a CUDA GPU is visible

    @staticmethod
    def here() -> "Machine":
        """This machine (imports torch to ask)."""
        import torch

        return Machine(cuda=torch.cuda.is_available())

    def on_cuda(self, cfg: RecpipeConfig) -> bool:
        """Whether ``cfg``'s run is on CUDA here (``train.device``: ``auto`` picks CUDA if there is a GPU)."""
        return cfg.train.device == "cuda" or (cfg.train.device == "auto" and self.cuda)


def rule_problems(cfg: RecpipeConfig) -> list[str]:
    """The rules of ``cfg``'s pipeline and of the speed features it enables, one line per
    problem: a feature the pipeline cannot serve is refused (or, where the feature has
    nothing to speed up there, its written section is ignored with a warning)."""
    p = cfg.pipeline
    definition = PIPELINES[p.name]
    problems = list(definition.check(cfg))
    for feature in SPEEDUPS.values():
        if not feature.enabled(p):
            continue
        lacking = feature.lacking(definition.offers)
        if lacking and feature.missing == "skip":
            feature.skipped(p, p.name)
            continue
        if lacking:
            what = "; ".join(f"{c} ({CAPABILITIES.get(c, 'a capability')})" for c in lacking)
            others = offering(feature.needs)
            problems.append(f"pipeline.{feature.name} needs {what}, which pipeline.name={p.name!r} does not offer; "
                            f"pipelines that do: {', '.join(others) or 'none'}")
            continue
        problems += feature.check(cfg)
    return problems


def check_rules(cfg: RecpipeConfig) -> None:
    """:func:`rule_problems` as a ``ConfigError`` naming every problem."""
    problems = rule_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems) if len(problems) > 1
                          else f"invalid config: {problems[0]}")


def check_machine(cfg: RecpipeConfig, machine: Machine) -> None:
    """Rules that depend on the machine: raises ConfigError naming every problem."""
    problems = []
    if cfg.train.device == "cuda" and not machine.cuda:
        problems.append("train.device='cuda' but this machine has no CUDA GPU")
    if not machine.on_cuda(cfg):
        uvm = [n for n, t in cfg.table_sharding().items() if t.kernel in ("fused_uvm", "fused_uvm_caching")]
        if uvm:
            problems.append(f"tables {uvm} use a UVM kernel (fused_uvm / fused_uvm_caching), which needs a CUDA GPU; "
                            "this run is on CPU")
        if cfg.optimizer.embedding.name == "adam":
            problems.append("optimizer.embedding.name='adam': FBGEMM's CPU kernels have no Adam; use 'sgd' or "
                            "'rowwise_adagrad' on CPU")
        problems += [f"pipeline.{f.name}=true needs a CUDA GPU; this run is on CPU" for f in SPEEDUPS.values()
                     if f.needs_cuda and f.options is not None and f.enabled(cfg.pipeline)]
        if cfg.distributed.backend == "nccl":
            problems.append("distributed.backend='nccl' needs CUDA GPUs; this run is on CPU (use 'gloo' or 'auto')")
        if cfg.sharding.placement == "planner":
            problems.append(PLANNER_ON_CPU)
    if cfg.logging.wandb is not None and importlib.util.find_spec("wandb") is None:  # optional: looked for, not imported
        problems.append("logging.wandb is set but the wandb package is not installed: `pip install wandb` (and "
                        "`wandb login`, or logging.wandb.mode: offline), or remove logging.wandb")
    if problems:
        raise ConfigError("invalid config for this machine:\n" + "\n".join(f"  {p}" for p in problems))


def preflight(cfg: RecpipeConfig, machine: Machine) -> None:
    """Every check of ``cfg`` before ``recpipe train`` starts a process (see the module
    docstring), in the order a user fixes them: the config's rules, checkpoints, the
    machine, the data, the model's tables, ``pipeline.class``."""
    from recpipe.builder import pipeline_class
    from recpipe.data import check_data
    from recpipe.sharding import check_model_config
    from recpipe.train.checkpoint import check_checkpoint_config

    check_rules(cfg)
    check_checkpoint_config(cfg.checkpoint)
    check_machine(cfg, machine)
    check_data(cfg)  # missing TSV files: ConfigError -> 2; a damaged binary dataset: BinaryDataError -> 5
    # The model's tables (a model.factory model's are known only now, built on meta)
    # against sharding.*: ConfigError -> exit 2.
    check_model_config(cfg, device_type="cuda" if machine.on_cuda(cfg) else "cpu")
    pipeline_class(cfg)  # pipeline.class imports and subclasses the pipeline's class


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _to_stdout(line: str) -> None:
    print(line, flush=True)


def check_memory(cfg: RecpipeConfig, machine: Machine, *, world_size: int | None = None,
                 log: Callable[[str], None] = _to_stdout, refusal: Callable[[str], None] = _to_stderr) -> int | None:
    """On CUDA: ``log`` the memory plan's per-rank summary and return ``EXIT_DOES_NOT_FIT``
    (3), after ``refusal`` says why and which changes make it fit, when the plan does not
    fit the GPU: before anything is allocated. A pure function of the config, so under
    torchrun every rank refuses alike. On CPU the tables live in host memory and the plan's
    GPU terms do not apply: nothing is printed (``recpipe plan`` shows what the config would
    need on GPUs), None."""
    if not machine.on_cuda(cfg):
        return None
    from recpipe.planner import advice_lines, advise, check_fits, plan_from_config, summary

    plan = plan_from_config(cfg, world_size=world_size)
    log(summary(plan))
    problem = check_fits(plan)
    if problem is None:
        return None
    advice = advise(cfg, plan) if world_size in (None, cfg.distributed.nproc) else []
    refusal(f"recpipe train: refusing to start, the configuration does not fit in GPU memory:\n{problem}\n"
            f"{advice_lines(advice)}")
    return EXIT_DOES_NOT_FIT

