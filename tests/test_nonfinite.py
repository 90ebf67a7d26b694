"""Non-finite losses: ``train.on_nonfinite=skip_step`` updates nothing on such a step,
in every pipeline and without a host sync, and stops the run like ``error`` once more
steps are skipped than ``train.max_skipped_steps`` allows; ``error`` stops the run
naming the step; a non-finite eval loss or weight stops it too, and no checkpoint of a
diverged model is written; ``summary.json`` stays strict JSON in every case."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import build, local_state, make_batches, small_config
from process_harness import TINY_MODEL
from recpipe.checkpoint.store import complete_checkpoints
from recpipe.cli import main
from recpipe.data.batch import Batch
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.exit_codes import EXIT_NONFINITE_LOSS
from recpipe.pipelines import PIPELINES
from recpipe.runtime.steps import dense_params
from recpipe.train.nonfinite import SkipNonFiniteSteps, finite_json

CONFIG = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
FUSED_TABLES = ["sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"]
POISONED_STEP = 2
# (config overrides, pipeline, options): every pipeline; base and sparse_dist also
# with a data_parallel table (updated by the dense optimizer), which the others refuse.
CASES = [
    ([], "base", {}),
    ([], "sparse_dist", {}),
    (FUSED_TABLES, "fused_sparse_dist", {}),
    (FUSED_TABLES, "semi_sync", {}),
    (FUSED_TABLES, "semi_sync", {"stash_gradients": True}),
    (FUSED_TABLES, "prefetch", {}),
]


def _run(cfg, name: str, batches: list[Batch], skip: bool, device: torch.device, **options) -> tuple[list[float], dict]:
    sm = build(cfg, device)
    if skip:
        guard = SkipNonFiniteSteps(sm.model, device)
        # It masks exactly what the dense optimizer applies (dense layers, data_parallel tables).
        assert {id(p) for p in guard.dense} == {id(p) for p in dense_params(sm.optimizer)}
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    pipe = PIPELINES[name](sm.model, sm.optimizer, device, **options)
    losses, it = [], iter(batches)
    while True:
        try:
            losses.append(pipe.progress(it)[0])
        except StopIteration:
            break
    dist.barrier()
    return [loss.item() for loss in losses], {k: v.cpu() for k, v in local_state(sm.model).items()}


def _poison(batches: list[Batch]) -> list[Batch]:
    b = batches[POISONED_STEP]
    nan = torch.full_like(b.dense_features, math.nan)
    return batches[:POISONED_STEP] + [Batch(nan, b.sparse_features, b.labels, b.weights)] + batches[POISONED_STEP + 1 :]


def _skip_worker(nproc: int, extra: list[str]) -> None:
    device = init_process_group(small_config(nproc, extra))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    for overrides, name, options in CASES:
        cfg = small_config(nproc, [*extra, *overrides])
        batches = make_batches(cfg, 6, rank)
        # Only the last rank's batch is poisoned: every rank must skip the whole step.
        poisoned = _poison(batches) if rank == last else batches
        # The reference: that step contributes exactly nothing on any rank (zero loss weights).
        reference = list(batches)
        reference[POISONED_STEP] = batches[POISONED_STEP].as_padding()
        losses, got = _run(cfg, name, poisoned, skip=True, device=device, **options)
        _, want = _run(cfg, name, reference, skip=False, device=device, **options)
        what = f"{device.type} {name} {options} {overrides}"
        assert math.isfinite(losses[POISONED_STEP]) == (rank != last), what
        different = [k for k in want if not torch.equal(got[k], want[k])]
        assert not different, f"{what}: the skipped step changed {different}"
    # The same poisoned step without skip_step spoils the weights: the check above can fail.
    cfg = small_config(nproc, extra)
    batches = make_batches(cfg, 6, rank)
    _, spoiled = _run(cfg, "base", _poison(batches) if rank == last else batches, skip=False, device=device)
    assert any(not torch.isfinite(v).all() for v in spoiled.values() if v.is_floating_point())


@pytest.mark.slow
def test_skip_step_updates_nothing_in_every_pipeline():
    launch_local(_skip_worker, 2, 2, [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nproc", [1, 2])
def test_skip_step_updates_nothing_on_cuda(nproc):
    launch_local(_skip_worker, nproc, nproc, ["train.device=cuda"])


def test_summary_json_is_strict():
    value = {"loss": math.nan, "auc": [1.0, math.inf], "n": 3}
    assert json.loads(json.dumps(finite_json(value), allow_nan=False)) == {"loss": None, "auc": [1.0, None], "n": 3}


def _strict_json(path: Path) -> dict:
    def refuse(constant: str):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


TINY = [
    *TINY_MODEL,
    "data.synthetic.num_batches=20",
    "data.synthetic.num_eval_batches=1",
    "train.eval_every=0",
    "train.log_every=5",
    "train.progress=false",
    "optimizer.embedding.lr=1e12",  # diverges within a few steps
    "optimizer.dense.lr=1e12",
]


def _train(*overrides: str) -> int:
    args = ["train", "--config", str(CONFIG)]
    for pair in TINY + list(overrides):
        args += ["--set", pair]
    return main(args)


@pytest.mark.slow
def test_diverging_run_stops_naming_the_step_and_saves_nothing_after_it(tmp_path, capfd):
    code = _train("train.steps=20", f"logging.run_dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=1")
    err = capfd.readouterr().err
    assert code == EXIT_NONFINITE_LOSS
    lines = [line for line in err.splitlines() if "non-finite loss at step" in line]
    assert len(lines) == 1, err  # both ranks stop; the message is printed once
    bad_step = int(lines[0].split("non-finite loss at step ")[1].split()[0])
    assert f"[exit {EXIT_NONFINITE_LOSS}]" in lines[0] and "Traceback" not in err
    summary = _strict_json(tmp_path / "summary.json")
    assert summary["status"] == "nonfinite_loss"
    # A checkpoint after every step, yet none holds weights the bad step touched.
    saved = [int(p.name.removeprefix("step_")) for p in complete_checkpoints(tmp_path / "ckpt")]
    assert all(step < bad_step for step in saved), (saved, bad_step)
    newest = f"newest checkpoint: {tmp_path / 'ckpt' / f'step_{max(saved):08d}'}" if saved else "no checkpoint in"
    assert newest in lines[0]


@pytest.mark.slow
def test_a_diverging_run_with_skip_step_stops_past_the_limit_and_saves_nothing(tmp_path, capfd):
    # lr 1e12: nearly every step's loss is non-finite. skip_step is for the rare bad
    # batch; past train.max_skipped_steps (1 in any 100 steps by default) the run stops
    # as with `error`, and the diverged model is not saved (checkpoint.dir set: the
    # final save would have written it).
    code = _train("train.steps=40", "train.on_nonfinite=skip_step", f"logging.run_dir={tmp_path}",
                  f"checkpoint.dir={tmp_path / 'ckpt'}")
    err = capfd.readouterr().err
    assert code == EXIT_NONFINITE_LOSS, err[-3000:]
    lines = [line for line in err.splitlines() if "too many non-finite losses" in line]
    assert len(lines) == 1 and "more than train.max_skipped_steps=1 in train.skipped_steps_window=100" in lines[0]
    assert f"[exit {EXIT_NONFINITE_LOSS}]" in lines[0] and "Traceback" not in err
    summary = _strict_json(tmp_path / "summary.json")
    assert summary["status"] == "nonfinite_loss" and len(summary["skipped_steps"]) >= 2, summary
    assert summary["steps"] < 40  # stopped at the log point that found them, not at the end
    assert not complete_checkpoints(tmp_path / "ckpt")


@pytest.mark.slow
def test_a_non_finite_eval_loss_stops_the_run(tmp_path, capfd):
    # One step at lr 1e12: its loss is finite (computed before the update), the weights
    # after it are not usable: the final evaluation's loss is NaN. An error, before the
    # final save: nothing is saved.
    code = _train("train.steps=1", "distributed.nproc=1", f"logging.run_dir={tmp_path}",
                  f"checkpoint.dir={tmp_path / 'ckpt'}")
    err = capfd.readouterr().err
    assert code == EXIT_NONFINITE_LOSS, err[-3000:]
    lines = [line for line in err.splitlines() if "non-finite" in line]
    assert len(lines) == 1 and f"[exit {EXIT_NONFINITE_LOSS}]" in lines[0], err[-3000:]
    assert "non-finite eval loss after step 1 (eval logloss nan)" in lines[0], lines[0]
    assert _strict_json(tmp_path / "summary.json")["status"] == "nonfinite_loss"
    assert not complete_checkpoints(tmp_path / "ckpt")


def test_non_finite_weights_are_never_saved():
    from recpipe.errors import NonFiniteLossError
    from recpipe.train.nonfinite import check_finite_weights

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    check_finite_weights(model, 7, "newest checkpoint: x")  # finite: nothing to say
    with torch.no_grad():
        model[1].bias.fill_(math.inf)
    with pytest.raises(NonFiniteLossError, match=(
            r"non-finite weights after step 7 \(1.bias\).*nothing saved after step 6")):
        check_finite_weights(model, 7, "newest checkpoint: x")


def test_skip_step_stops_past_max_skipped_steps_in_a_window():
    from recpipe.errors import NonFiniteLossError
    from recpipe.train.nonfinite import NonFiniteCheck

    check = NonFiniteCheck("skip_step", torch.device("cpu"), lambda: "no checkpoint", max_skipped=1, window=10)

    def steps(*losses: float, last: int) -> list[int]:
        for loss in losses:
            check.record(torch.tensor(loss))
        return check.check(last)

    assert steps(1.0, math.nan, 1.0, last=3) == [2]  # one in ten: skipped
    assert steps(*[1.0] * 9, math.inf, last=13) == [13]  # the next is 11 steps later: allowed
    with pytest.raises(NonFiniteLossError, match=r"2 of the 10 steps up to step 20 were skipped \(steps 13, 20\)"):
        steps(*[1.0] * 6, math.nan, last=20)
