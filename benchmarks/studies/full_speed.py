"""Does a configuration train the same at full speed as fed slowly? The same run with its
loader at full speed and the host ahead of the device, against a reference whose host waits
for the device after every step (``--lockstep``), bit for bit: every step's loss and the final
eval metrics.

    python3 benchmarks/studies/full_speed.py --config configs/bench/dlrm_criteo.yaml \
        --set train.precision=bf16 --set pipeline.step_graph=true --set pipeline.compile.enabled=true \
        --set train.steps=1000 --set data.synthetic.num_batches=1100 \
        --reference data.num_workers=0 --variant data.num_workers=12 --variant data.num_workers=4 \
        --repeat 3 --out runs/full_speed

Every run trains a fresh model in this process (one rank), in order: the reference (its
overrides, host in lockstep unless ``--no-lockstep``), then each variant ``--repeat`` times.
Per run: the mean loss of each log interval, the final eval AUC and NE, the samples/s the
trainer reports, ``host_waits`` (steps after which the host had queued
``pipeline.steps_ahead`` steps and waited for the device: the device set the pace) and
whether it equals the reference. Writes OUT/full_speed.json and OUT/full_speed.md.

Tests use :func:`train` and :func:`train_resumed` (tests/test_full_speed.py, its GPU twin):
:func:`train` runs :class:`~recpipe.train.trainer.Trainer` on one rank in this process (several
in ``launch_local``'s) and keeps every step's loss (a device tensor, read at the end: no host
sync per step), the final eval metrics and ``host_waits``. With ``lockstep`` the host waits for
the device after every step, so no batch's memory can be touched by a later batch's work
before its step is done. :func:`train_resumed` is the same run in two commands, the second
resuming from the checkpoint the first saved.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.studies.common import command, config_parser  # noqa: E402
from recpipe.bench.measure import free_device_memory  # noqa: E402
from recpipe.bench.report import environment  # noqa: E402
from recpipe.bench.runner import single_rank_group  # noqa: E402
from recpipe import deterministic  # noqa: E402
from recpipe.config import RecpipeConfig, load_config  # noqa: E402
from recpipe.distributed import init_process_group, shutdown_process_group  # noqa: E402
from recpipe.launcher import launch_local  # noqa: E402
from recpipe.train.trainer import Trainer  # noqa: E402


@dataclass
class Trained:
    losses: torch.Tensor  # one per step, on the host
    eval: dict[str, float]
    host_waits: int | None
    steps: int
    samples_per_s: float | None = None  # the trainer's (summary.json)


def config(base: list[str], run: Path, overrides: list[str]) -> RecpipeConfig:
    return load_config(None, [*base, f"logging.run_dir={run / 'logs'}", f"checkpoint.dir={run / 'ckpt'}",
                              "train.progress=false", "train.eval_every=0", *overrides])


def train(cfg: RecpipeConfig, lockstep: bool = False) -> Trained:
    """Train ``cfg``: one rank in this process, several in ``launch_local``'s (rank 0's result)."""
    if cfg.distributed.nproc == 1:
        with single_rank_group(), deterministic.kept():  # the run's train.deterministic ends with it
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
                   trainer.position.step, trainer.summary()["samples_per_s"])


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


# ------------------------------------------------------------------ the study
def _run_md(label: str, t: Trained, log_every: int, same: list[str] | None) -> str:
    means = [f"{m:.4f}" for m in t.losses.view(-1)[: len(t.losses) // log_every * log_every]
             .view(-1, log_every).double().mean(dim=1).tolist()]
    verdict = "reference" if same is None else ("equal" if not same else "differs: " + "; ".join(same))
    auc, ne = t.eval.get("auc"), t.eval.get("ne")
    rate = f"{t.samples_per_s:,.0f}" if t.samples_per_s else "-"
    return (f"| {label} | {' '.join(means)} | {auc if auc is None else f'{auc:.4f}'} / "
            f"{ne if ne is None else f'{ne:.4f}'} | {rate} | {t.host_waits} | {verdict} |")


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(__doc__)
    parser.add_argument("--reference", action="append", default=[], metavar="KEY=VALUE",
                        help="the reference run's own overrides (default: data.num_workers=0)")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="a run compared with the reference: its overrides, comma-separated (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each variant")
    parser.add_argument("--no-lockstep", dest="lockstep", action="store_false",
                        help="the reference's host does not wait for the device after every step")
    parser.add_argument("--out", default="runs/full_speed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [*(f"{o}" for o in args.overrides), "train.eval_every=0", "train.progress=false"]

    def cfg(run: str, extra: list[str]) -> RecpipeConfig:
        return load_config(args.config, [*base, f"logging.run_dir={out / run}", "checkpoint.dir=null", *extra])

    reference = args.reference or ["data.num_workers=0"]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    started = time.perf_counter()
    runs: list[tuple[str, Trained, list[str] | None]] = []
    ref = train(cfg("reference", reference), lockstep=args.lockstep)
    label = ", ".join(reference) + (" (lockstep)" if args.lockstep else "")
    runs.append((label, ref, None))
    print(_run_md(label, ref, cfg("reference", reference).train.log_every, None), flush=True)
    for v, variant in enumerate(args.variant):
        overrides = [o.strip() for o in variant.split(",") if o.strip()]
        for r in range(args.repeat):
            free_device_memory(device)
            c = cfg(f"variant{v}_{r}", overrides)
            t = train(c)
            same = differences(t, ref)
            label = ", ".join(overrides) + (f" (run {r + 1})" if args.repeat > 1 else "")
            runs.append((label, t, same))
            print(_run_md(label, t, c.train.log_every, same), flush=True)
    log_every = cfg("reference", reference).train.log_every
    env = environment(device, 1, [torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"])
    v = env["versions"]
    lines = [f"# Full speed against the reference: `{args.config}`", "", f"Command: `{command('full_speed', argv)}`", "",
             f"- {env['gpu']['name']}, host of {env['host']['cpus']} cores; torch {v['torch']}, fbgemm-gpu "
             f"{v['fbgemm_gpu']}, torchrec {v['torchrec']}" + (f", CUDA {v['cuda']}" if v["cuda"] else ""), "",
             f"Mean loss of each log interval ({log_every} steps), final eval, the trainer's samples/s, the steps after "
             "which the host waited for the device, and whether every step's loss and the eval metrics equal the "
             "reference's bit for bit.", "",
             "| run | loss per log interval | eval AUC / NE | samples/s | host waits | vs reference |",
             "|---|---|---|---:|---:|---|", *(_run_md(lab, t, log_every, same) for lab, t, same in runs), "",
             f"{len(runs)} runs in {time.perf_counter() - started:.0f} s."]
    (out / "full_speed.md").write_text("\n".join(lines) + "\n")
    (out / "full_speed.json").write_text(json.dumps([
        {"run": lab, "losses": t.losses.tolist(), "eval": t.eval, "host_waits": t.host_waits,
         "samples_per_s": t.samples_per_s, "differences": same} for lab, t, same in runs], indent=1))
    print(f"wrote {out / 'full_speed.md'}")
    return 0 if all(not same for _, _, same in runs if same is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
