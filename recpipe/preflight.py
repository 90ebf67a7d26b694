"""Every check of a config before launch, in one place: :func:`preflight`.

``load_config`` (``recpipe.config``) validates the config itself: types, allowed values
and the rules between its own fields. What depends on more than the config is checked
here, above it, before any process starts:

1. the rules of the pipeline and of the speed features it enables
   (:func:`check_rules`: ``PipelineDef.check``, ``SpeedupDef.check``, and each enabled
   feature against the capabilities the pipeline offers);
2. the machine (:func:`check_machine`: a CUDA GPU for what needs one, FBGEMM's CPU
   kernels, the distributed backend, optional packages);
3. ``checkpoint.dir`` and ``logging.run_dir`` as paths (:func:`check_dir_paths`, exit 6),
   ``checkpoint.dir`` (another run's checkpoints; the settings of the checkpoint a resume
   starts from), the data's files, the model's tables against ``sharding.*``, the model's
   tensors against the checkpoint a resume starts from, and ``pipeline.class``;
4. the memory plan (:func:`check_memory`, exit 3): on CUDA each rank against its GPU,
   with the cheapest changes that make it fit; on CPU the ranks of this machine together
   against its available memory.

Every problem of 1-3 is a ``ConfigError`` naming its key (exit 2), a ``DataError`` (exit 5),
or a ``StorageError`` (exit 6).
``recpipe plan`` and the bench run :func:`check_rules` (the machine there is not the
one that trains); ``recpipe train`` and :func:`recpipe.train.train` run all of it. This
module imports nothing heavy: the checks of steps 3 and 4 import what they check (the
data readers, torchrec, the user's class, the planner) when they run.
"""

from __future__ import annotations

import errno
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from recpipe.capabilities import CAPABILITIES, PREFETCH_STEP
from recpipe.config import PLANNER_ON_CPU, RecpipeConfig, TrainConfig
from recpipe.embedding_tables import model_on_meta
from recpipe.errors import ConfigError, DoesNotFitError, StorageError, job_warning, report
from recpipe.exit_codes import EXIT_DOES_NOT_FIT
from recpipe.pipelines.registry import PIPELINES, offering
from recpipe.planner import MemoryPlan, advice_lines, advise, check_fits, plan_from_config, summary
from recpipe.planner.plan import fmt_bytes
from recpipe.speedups.registry import SPEEDUPS

if TYPE_CHECKING:
    from recpipe.planner.plan import RankMemory

__all__ = ["CPU_RANK_BYTES", "Machine", "check_dir_paths", "check_machine", "check_memory", "check_rules",
           "host_memory_available", "host_memory_problem", "preflight", "rule_problems"]


@dataclass(frozen=True)
class Machine:
    """What the checks need to know of the machine that launches the run."""

    cuda: bool  # a CUDA GPU is visible

    @staticmethod
    def here() -> "Machine":
        """This machine (imports torch to ask)."""
        import torch

        return Machine(cuda=torch.cuda.is_available())

    def on_cuda(self, train: TrainConfig) -> bool:
        """Whether the run is on CUDA here (``train.device``: ``auto`` picks CUDA if there is a GPU)."""
        return train.device == "cuda" or (train.device == "auto" and self.cuda)


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
    if cfg.data.synthetic.device == "cuda" and not machine.cuda:
        problems.append("data.synthetic.device='cuda' but this machine has no CUDA GPU")
    if not machine.on_cuda(cfg.train):
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
    p = cfg.pipeline
    if PREFETCH_STEP in PIPELINES[p.name].offers and not any(t.kernel == "fused_uvm_caching"
                                                             for t in cfg.table_sharding().values()):
        problems.append(f"pipeline.name={p.name!r} prefetches the rows of UVM-cached tables, and no table has kernel "
                        "'fused_uvm_caching' (which needs a CUDA GPU): set one, or use pipeline.name='sparse_dist'")
    if not machine.on_cuda(cfg.train):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.distributed.nproc))
        if cores and local > cores:  # under torchrun every rank checks: rank 0 says it
            job_warning(f"distributed.nproc={cfg.distributed.nproc}: {local} CPU ranks on this machine's {cores} "
                        "usable core(s): ranks compute on one core each and wait for one another at every collective, "
                        "so they take turns")
    if cfg.logging.wandb is not None and importlib.util.find_spec("wandb") is None:  # optional: looked for, not imported
        problems.append("logging.wandb is set but the wandb package is not installed: `pip install wandb` (and "
                        "`wandb login`, or logging.wandb.mode: offline), or remove logging.wandb")
    if problems:
        raise ConfigError("invalid config for this machine:\n" + "\n".join(f"  {p}" for p in problems))


def preflight(cfg: RecpipeConfig, machine: Machine) -> None:
    """Every check of ``cfg`` before ``recpipe train`` starts a process (see the module
    docstring), in the order a user fixes them: the config's rules, checkpoints, the
    machine, the data, the model's tables, ``pipeline.class``."""
    # torch and torchrec: `recpipe plan` runs this module's check_rules without them
    from recpipe.builder import pipeline_class
    from recpipe.data import check_data
    from recpipe.sharding import check_model_config
    from recpipe.checkpoint.store import check_checkpoint_config, check_resume, check_resume_shapes

    check_rules(cfg)
    check_dir_paths(cfg.checkpoint.dir, cfg.logging.run_dir)  # StorageError -> exit 6
    check_checkpoint_config(cfg.checkpoint)
    check_resume(cfg)  # another distributed.nproc, optimizer or model setting than the checkpoint's
    check_machine(cfg, machine)
    check_data(cfg)  # missing TSV files: ConfigError -> 2; a damaged binary dataset: BinaryDataError -> 5
    # The model's tables (a model.factory model's are known only now, built on meta)
    # against sharding.*: ConfigError -> exit 2.
    model = model_on_meta(cfg)
    check_model_config(cfg, model, device_type="cuda" if machine.on_cuda(cfg.train) else "cpu")
    # Its tensors against the checkpoint a resume loads: ConfigError -> 2; a checkpoint
    # whose metadata would run code: UnsafeCheckpointError -> 6.
    check_resume_shapes(cfg.checkpoint, model)
    pipeline_class(cfg)  # pipeline.class imports and subclasses the pipeline's class


def _to_stdout(line: str) -> None:
    print(line, flush=True)


def _refuse(message: str) -> None:
    report("train", DoesNotFitError(message))


def check_memory(cfg: RecpipeConfig, machine: Machine, *, world_size: int | None = None,
                 log: Callable[[str], None] = _to_stdout, refusal: Callable[[str], None] = _refuse) -> int | None:
    """``EXIT_DOES_NOT_FIT`` (3), after ``refusal`` says why, when the memory plan does not fit,
    before anything is allocated; else None. A pure function of the config and the machine,
    so under torchrun every rank refuses alike. On CUDA: ``log`` the plan's per-rank summary
    and check each rank against its GPU, with the changes that make it fit. On CPU the
    tables, optimizer states and batches the plan counts live in host memory: the ranks on
    this machine together against its available memory (nothing is logged: ``recpipe
    plan`` shows what the config would need on GPUs)."""
    plan = plan_from_config(cfg, world_size=world_size)
    if not machine.on_cuda(cfg.train):
        problem = host_memory_problem(plan, int(os.environ.get("LOCAL_WORLD_SIZE", world_size or cfg.distributed.nproc)))
        if problem is None:
            return None
        refusal(f"refusing to start, the configuration does not fit in this machine's memory: {problem}")
        return EXIT_DOES_NOT_FIT
    log(summary(plan))
    problem = check_fits(plan)
    if problem is None:
        return None
    advice = advise(cfg, plan) if world_size in (None, cfg.distributed.nproc) else []
    refusal(f"refusing to start, the configuration does not fit in GPU memory:\n{problem}\n{advice_lines(advice)}")
    return EXIT_DOES_NOT_FIT


# What a CPU rank holds beyond its plan's tables, optimizer state and batches: its share of
# the interpreter, torch, torchrec and FBGEMM, Gloo's buffers, the training loop. A
# calibration (torch 2.13 CPU, torchrec 1.8, fbgemm-gpu-cpu 1.8, x86): configs/quickstart.yaml
# with train.device=cpu at 2 to 64 ranks through `recpipe train`, every process's
# /proc/PID/smaps_rollup polled for its peak proportional set size (PSS: its own pages, shared
# ones divided among their sharers). A rank forked from the launcher's preloaded server
# (recpipe.launch_preload) shares the server's imported pages, so its PSS is well below the
# RSS that `peak RSS` in the log says; the job's PSS grew by about this constant per rank,
# nearly all of it beyond the plan's own terms. Measure again this way when those libraries
# change. A rank under torchrun imports for itself, most of it before it runs this check,
# which then finds it in use already.
CPU_RANK_BYTES = 256 * 2**20
# Plan terms that only a CUDA rank has.
CUDA_ONLY_TERMS = ("cublas_workspace",)


def host_memory_problem(plan: "MemoryPlan", local_ranks: int) -> str | None:
    """Why ``local_ranks`` CPU ranks of ``plan`` cannot be held by this machine's available
    memory (the largest ranks of the plan, as a node of torchrun may hold any), or None:
    each rank needs ``CPU_RANK_BYTES`` for its process plus what its plan holds (the
    tables, optimizer states, batches and activations a CPU run keeps in host memory)."""
    ranks = sorted(plan.ranks, key=_host_bytes, reverse=True)[:local_ranks]
    needed = sum(CPU_RANK_BYTES + _host_bytes(r) for r in ranks)
    available = host_memory_available()
    if available is None or needed <= available:
        return None
    counted = [t for t in ranks[0].terms if t.side == "hbm" and t.category in ("static", "per_step")
               and t.name not in CUDA_ONLY_TERMS]
    big = ", ".join(f"{t.name} {fmt_bytes(t.bytes)}" for t in sorted(counted, key=lambda t: -t.bytes)[:3])
    return (f"{len(ranks)} rank(s) on CPU need about {fmt_bytes(needed)}: {fmt_bytes(CPU_RANK_BYTES)} a rank for its "
            f"process (measured: torch, torchrec, FBGEMM, Gloo, the loop) plus its tables, optimizer state and batches "
            f"(rank {ranks[0].rank}: {fmt_bytes(_host_bytes(ranks[0]))}, largest {big}); {fmt_bytes(available)} is "
            "available: shrink the tables or data.batch_size, lower distributed.nproc, or train on GPUs")


def _host_bytes(rank: "RankMemory") -> int:
    """A CPU rank's planned bytes in host memory: every allocated term but the CUDA-only ones."""
    return rank.hbm_allocated_bytes - sum(rank.term(name) for name in CUDA_ONLY_TERMS) + rank.ddr_bytes


def host_memory_available() -> int | None:
    """This machine's available memory (MemAvailable of /proc/meminfo), or None off Linux."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Room under a run directory for the files recpipe writes there (step_00000500/__12_0.distcp,
# rerun_2/events.out.tfevents.<time>.<host>.<pid>.<n>, ...) within the system's PATH_MAX.
_ROOM_BELOW = 256


def check_dir_paths(checkpoint_dir: str | None, run_dir: str | None) -> None:
    """``checkpoint_dir`` (``checkpoint.dir``) and ``run_dir`` (``logging.run_dir``) as paths
    the system can use, before any process starts: no symlink loop, no component longer than
    its filesystem's NAME_MAX, and room under PATH_MAX for the files written there. A ``StorageError`` (exit 6) names
    the key and the cause; what only a write tells (permissions, a full disk) is found
    when the directory is created."""
    for key, directory in (("checkpoint.dir", checkpoint_dir), ("logging.run_dir", run_dir)):
        if directory is not None:
            problem = _dir_path_problem(os.path.abspath(directory))
            if problem is not None:
                shown = repr(directory) if len(directory) <= 120 else f"{directory[:80]!r}... ({len(directory)} characters)"
                raise StorageError(f"cannot use {key}={shown}: {problem}")


def _dir_path_problem(path: str) -> str | None:
    """Why the system cannot resolve ``path`` (absolute), or None."""
    try:
        os.stat(path)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENAMETOOLONG):
            return os.strerror(err.errno) + (" (a symbolic link that leads back to itself)" if err.errno == errno.ELOOP
                                             else "")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        return None
    too_long = [part for part in path.split(os.sep) if len(os.fsencode(part)) > name_max]
    if too_long:
        return (f"{os.strerror(errno.ENAMETOOLONG)}: a component of {len(os.fsencode(too_long[0]))} bytes, "
                f"{name_max} at most ({too_long[0][:40]}...)")
    if len(os.fsencode(path)) + _ROOM_BELOW > path_max:
        return (f"{os.strerror(errno.ENAMETOOLONG)}: {len(os.fsencode(path))} bytes leave less than {_ROOM_BELOW} of "
                f"the system's {path_max} for the files written under it")
    return None
