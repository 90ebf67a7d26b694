"""Evaluation through every pipeline's eval schedule (recpipe.pipelines.evaluation) gives
the plain loop's outputs and metrics bit for bit, on uneven eval data with a partial last
batch, and training continues after it exactly as after the plain loop. Gloo on CPU
(1 and 2 processes); tests/test_eval_pipeline_gpu.py runs the same worker on CUDA."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import assert_same, build, local_state, make, make_batches, small_config, RunResult
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES
from recpipe.pipelines.defs import base
from recpipe.pipelines.evaluation import PLAIN_SCHEDULE, Evaluation, eval_schedule_of
from recpipe.runtime import steps
from recpipe.train.metrics import ClickMetrics, click_outputs

NAMES = ("base", "sparse_dist", "fused_sparse_dist", "semi_sync", "prefetch")
# semi_sync and fused_sparse_dist's default order need every table updated inside the TBE backward
TABLES = ["sharding.tables={t_cat_1: {type: row_wise}, t_cat_2: {type: column_wise}}"]
PARTIAL = 10  # samples in each rank's last eval batch (data.batch_size is 16)


def batches_of(cfg, n: int, rank: int, seed: int, zipf: bool = False) -> list:
    """``n`` batches: the harness's (few distinct ids), or with ``zipf`` the synthetic click
    log's (Zipf ids over whole tables: on a small UVM cache, evictions and conflict misses)."""
    if not zipf:
        return make_batches(cfg, n, rank, seed=seed)
    from recpipe.data.synthetic import SyntheticClickLog
    from recpipe.data.spec import DataSpec

    log = SyntheticClickLog(DataSpec.from_config(cfg))
    return [log.batch(rank=rank, split="train", epoch=seed, index=i) for i in range(n)]


def eval_batches(cfg, rank: int, world: int, zipf: bool = False) -> list:
    """Rank r: 2 + r full batches and one partial one. Two ranks: 3 and 4 batches, so rank 0
    pads once; its padding batch is its partial last one, while rank 1 evaluates its own."""
    full = batches_of(cfg, 2 + rank, rank, 7, zipf)
    short = cfg.model_copy(update={"data": cfg.data.model_copy(update={"batch_size": PARTIAL})})
    return full + batches_of(short, 1, rank, 8, zipf)


def reference_eval(pipe, batches: list, device: torch.device) -> list:
    """The plain loop: ``model(batch.to(device))`` outside the pipeline, in eval mode, under
    no_grad; a rank that has run out feeds its last batch with zero weights until no rank has
    a batch left (the padding every rank needs for the collectives of the others' forwards)."""
    count = torch.tensor([len(batches)], device=device)  # NCCL reduces device tensors only
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    model, outputs = pipe.model, []
    with pipe.detached(), torch.no_grad():
        model.eval()
        for i in range(int(count)):
            padding = i >= len(batches)
            batch = batches[-1].as_padding() if padding else batches[i]
            outputs.append((model(batch.to(device, non_blocking=True)), padding))
        model.train()
    return outputs


def clicks_of(outputs: list, device: torch.device) -> tuple[list, dict[str, float]]:
    """Each batch's (logits, labels, weights) as the trainer reads them, and the metrics."""
    metrics, rows = ClickMetrics(device), []
    for result, padding in outputs:
        logits, labels, weights = click_outputs(result[1])
        weights = torch.zeros_like(labels) if padding else torch.ones_like(labels) if weights is None else weights
        metrics.update(logits, labels, weights)
        rows.append((logits.cpu(), labels.cpu(), weights.cpu()))
    return rows, metrics.compute()


def train_steps(pipe, batches: list, losses: list) -> None:
    it = iter(batches)
    while True:
        try:
            losses.append(pipe.progress(it)[0].detach().cpu())
        except StopIteration:
            return


def assert_same_outputs(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} batches"
    for i, (x, y) in enumerate(zip(a, b)):
        for name, s, t in zip(("logits", "labels", "weights"), x, y):
            assert s.shape == t.shape and torch.equal(s, t), f"{what}: batch {i} {name} differ: {s} vs {t}"


def _worker(cfg, runs: tuple = tuple((name, {}) for name in NAMES), zipf: bool = False) -> None:
    """For each (pipeline, ``make`` options) of ``runs``: model A trains, evaluates with the plain
    loop written out and the engine's plain loop, trains on; model B trains, evaluates pipelined
    (and once more, left after its first batch), trains on. The three evaluations' outputs and
    metrics are equal, and so are A's and B's losses and weights at the end."""
    from recpipe.pipelines.prefetch import cached_tbes

    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    before, after = batches_of(cfg, 3, rank, 1, zipf), batches_of(cfg, 3, rank, 2, zipf)
    evals = eval_batches(cfg, rank, world, zipf)
    if device.type == "cuda":
        before, after, evals = ([b.pin_memory() for b in bs] for bs in (before, after, evals))
    for name, options in runs:
        # A: train, the plain loop written out, the engine's plain loop, train on.
        sm = build(cfg, device)
        pipe = make(name, sm, device, **options)
        losses_a: list = []
        train_steps(pipe, before, losses_a)
        ref = reference_eval(pipe, evals, device)
        plain = list(Evaluation(pipe, pipelined=False).run(evals))
        train_steps(pipe, after, losses_a)
        state_a = local_state(sm.model)
        pipe.detach()
        # B: train, the pipelined evaluation, one left after its first batch, train on.
        sm = build(cfg, device)
        pipe = make(name, sm, device, **options)
        losses_b: list = []
        train_steps(pipe, before, losses_b)
        pipelined = list(Evaluation(pipe).run(evals))
        with contextlib.closing(Evaluation(pipe).run(evals)) as stopped:
            next(stopped)
        assert pipe.attached and pipe.in_flight() == 0 and sm.model.training
        for tbe in cached_tbes(sm.model):  # the eval forwards' cache-line locks and prefetches are gone
            assert int(tbe.lxu_cache_locking_counter.abs().sum()) == 0 and not tbe.lxu_cache_locations_list
        train_steps(pipe, after, losses_b)
        state_b = local_state(sm.model)
        pipe.detach()

        want, want_metrics = clicks_of(ref, device)
        assert len(want) == world + 2  # the last rank's 2 + (world - 1) full batches and its partial one
        assert [p for _, p in ref] == [p for _, p in plain] == [p for _, p in pipelined]
        for what, outputs in (("plain", plain), ("pipelined", pipelined)):
            got, got_metrics = clicks_of(outputs, device)
            assert_same_outputs(want, got, f"{name} {options} {device.type} {what} eval")
            assert got_metrics == want_metrics, f"{name} {what}: {got_metrics} != {want_metrics}"
        assert_same(RunResult(losses_a, [], state_a), RunResult(losses_b, [], state_b),
                    f"{name} {options} {device.type}: training after the pipelined evaluation")
        dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_pipelined_eval_equals_the_plain_loop_for_every_pipeline(nproc):
    launch_local(_worker, nproc, small_config(nproc, overrides=TABLES))


def _host_splits_worker(cfg) -> None:
    """pipeline.splits_exchange=host: the evaluation's input dists exchange their splits on
    the host too (the feature wraps the eval schedule's input_dist), with the plain loop's
    outputs."""
    from recpipe.runtime import sharded

    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    evals = eval_batches(cfg, rank, world)
    pipe = make("sparse_dist", build(cfg, device), device, splits_exchange="host")
    train_steps(pipe, batches_of(cfg, 3, rank, 1), [])
    plain = list(Evaluation(pipe, pipelined=False).run(evals))
    made: list[str] = []
    real = sharded.FusedSplits.__init__

    def counting(self, *a, **k):  # the fused exchanges, by kind
        real(self, *a, **k)
        made.append(type(self._splits_awaitable).__name__)

    sharded.FusedSplits.__init__ = counting
    try:
        pipelined = list(Evaluation(pipe).run(evals))
    finally:
        sharded.FusedSplits.__init__ = real
    assert_same_outputs(clicks_of(plain, device)[0], clicks_of(pipelined, device)[0], "host splits eval")
    # the eval's first input dist goes unfused (torchrec's own all-to-alls), every later one on the host
    assert made[0] == "NoneType" and set(made[1:]) == {"HostSplitsExchange"}, made


def test_evaluation_exchanges_splits_on_the_host_like_its_training():
    launch_local(_host_splits_worker, 2, small_config(2, overrides=TABLES))


def _step_graph_worker(cfg) -> None:
    """A step graph (stand-in capture, as in tests/test_step_graph.py) in padding mode: its
    schedule intercepts no module, so the evaluation runs base's eval schedule on the model's
    own forward (step graph's padding-bag forward installed; the pipelined one through the
    eval graph, tests/test_eval_graph.py); nothing of the captured training step runs in it,
    and training continues as after the plain loop."""
    from recpipe.speedups.step_graph import StepGraphOptions, apply_step_graph

    device = init_process_group(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    before, after = make_batches(cfg, 5, rank, seed=1), make_batches(cfg, 3, rank, seed=2)
    evals = eval_batches(cfg, rank, world)
    runs = {}
    for pipelined in (False, True):
        sm = build(cfg, device)
        pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, device)
        graph = apply_step_graph(pipe.context, StepGraphOptions(enabled=True, capacity_batches=2), capture=lambda step: step)
        losses: list = []
        train_steps(pipe, before, losses)
        assert graph.padded and graph.replays > 0, graph
        seen = (graph.replays, graph.eager_steps, len(graph._counts))
        evaluation = Evaluation(pipe, pipelined=pipelined)
        assert evaluation.schedule is (base.EVAL_SCHEDULE if pipelined else PLAIN_SCHEDULE)
        ref = reference_eval(pipe, evals, device)
        outputs = list(evaluation.run(evals))
        assert (graph.replays, graph.eager_steps, len(graph._counts)) == seen, graph
        train_steps(pipe, after, losses)
        runs[pipelined] = (clicks_of(ref, device), clicks_of(outputs, device),
                           RunResult(losses, [], local_state(sm.model)))
    for pipelined, ((want, want_metrics), (got, got_metrics), _) in runs.items():
        assert_same_outputs(want, got, f"step graph, pipelined={pipelined}")
        assert got_metrics == want_metrics
    assert_same(runs[False][2], runs[True][2], "step graph: training after the pipelined evaluation")
    dist.barrier()


@pytest.mark.slow
def test_step_graph_pipeline_evaluates_without_its_captured_step():
    tables = ["sharding.tables={t_cat_1: {type: table_wise}, t_cat_2: {type: column_wise}, t_cat_3: {type: table_wise}}"]
    launch_local(_step_graph_worker, 2, small_config(2, overrides=tables))


def test_eval_schedules_are_training_steps_without_the_update(capsys):
    """Each pipeline's eval schedule: its training steps, same stream and batch offset, without
    zero_grad/backward/optimizer, and forward_eval for forward; printed by ``recpipe schedule``."""
    from recpipe.cli import main

    for name, definition in PIPELINES.items():
        evaluation = definition.eval_schedule.validate()
        train = {(s.name, s.stream, s.offset) for s in definition.schedules[0].steps}
        steps = {(s.name, s.stream, s.offset) for s in evaluation.steps}
        assert ("forward_eval", "compute", 0) in steps and ("forward", "compute", 0) in train, name
        assert steps - {("forward_eval", "compute", 0)} <= train, (name, steps - train)
        assert not {s for s, *_ in steps} & {"zero_grad", "backward", "optimizer", "forward"}, name
        assert main(["schedule", name]) == 0
        printed = capsys.readouterr().out
        assert printed.rstrip().endswith(evaluation.table().splitlines()[-1]), name  # the eval schedule comes last
        assert f"schedule {evaluation.name}:" in printed


def test_eval_plans_fence_only_across_streams():
    """Compiled for distinct stand-in streams (as on CUDA): every wait across streams is a
    fence on an event recorded after the step it names; waits on the same stream are dropped."""
    import types

    from recpipe.pipelines.evaluation import EvalPipeline
    from recpipe.runtime.streams import Streams

    s = {role: object() for role in ("compute", "memcpy", "dist", "prefetch")}
    streams = Streams(s["compute"], s["memcpy"], s["dist"], s["dist"], s["prefetch"])
    for schedule in [d.eval_schedule for d in PIPELINES.values()] + [PLAIN_SCHEDULE]:
        pipe = object.__new__(EvalPipeline)  # only what compiling a plan reads
        pipe.context = types.SimpleNamespace(streams=streams)
        pipe.max_batches_ahead, pipe._plans, pipe.schedule = None, {}, schedule
        pipe._wrappers, pipe._extra_steps = {}, {}
        _, ops, by_name = pipe._plan(schedule)
        stream_of = {step.name: streams.by_role(step.stream) for step in schedule.steps}
        for op in ops:
            cross = tuple((d, k) for d, k in op.step.waits if stream_of[d] is not op.stream)
            assert op.stream is stream_of[op.step.name] and op.fences == cross, (schedule.name, op.step.name)
            assert all(by_name[dep].record for dep, _ in cross), (schedule.name, op.step.name)
        assert by_name["forward_eval"].fn is steps.forward_eval


def test_which_eval_schedule_a_pipeline_runs():
    """Its own; base's where its model runs its own sharded forward (base; a step graph's
    schedule intercepts no module) or its definition states none; the plain one when asked."""
    import dataclasses
    import types

    for name, definition in PIPELINES.items():
        pipe = object.__new__(definition.engine_class())  # only what choosing a schedule reads
        pipe.definition = definition
        pipe.context = types.SimpleNamespace(modules={"sparse.ebc": object()} if definition.intercepts else {})
        assert eval_schedule_of(pipe) is definition.eval_schedule, name
        assert Evaluation(pipe, pipelined=False).schedule is PLAIN_SCHEDULE
        pipe.context.modules = {}
        assert eval_schedule_of(pipe) is base.EVAL_SCHEDULE, name

    custom = object.__new__(PIPELINES["sparse_dist"].engine_class())
    custom.definition = dataclasses.replace(PIPELINES["sparse_dist"], name="custom", eval_schedule=None)
    custom.context = types.SimpleNamespace(modules={"sparse.ebc": object()})
    assert eval_schedule_of(custom) is base.EVAL_SCHEDULE


def test_plain_schedule_is_the_plain_loop():
    """One batch at a time on the compute stream: the copy of batch i+1 queued after forward(i)."""
    assert PLAIN_SCHEDULE.depth == 2 and PLAIN_SCHEDULE.roles == frozenset({"compute"})
    assert [s.name for s in PLAIN_SCHEDULE.steps] == ["forward_eval", "h2d"]


def _train(run, *extra: str) -> int:
    from pathlib import Path

    from recpipe.cli import main

    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    config = run.parent / f"{run.name}.yaml"  # quickstart's, the data made by the factory
    config.write_text("\n".join(line for line in quickstart.read_text().splitlines() if "source: synthetic" not in line))
    sets = ["model.num_embeddings_per_feature=[500, 500, 200, 200, 100, 100]", "model.embedding_dim=8",
            "model.dense_arch_layer_sizes=[16, 8]", "model.over_arch_layer_sizes=[32, 1]",
            "sharding.tables={t_cat_0: {type: row_wise}}", "data.batch_size=128", "data.synthetic.num_eval_batches=5",
            "data.factory=eval_data:uneven_eval", "train.steps=4", "train.eval_every=2", "train.log_every=2",
            "train.progress=false", f"logging.run_dir={run}", *extra]
    return main(["train", "--config", str(config), *[a for s in sets for a in ("--set", s)]])


@pytest.mark.slow
def test_trainer_evaluates_uneven_eval_data_pipelined_as_plain_and_reports_samples_per_s(tmp_path, capfd):
    """Two ranks with 3 and 4 eval batches (a user's data.factory): the trainer's pipelined
    evaluation gives the plain loop's metrics exactly; samples/s and the host's time waiting for
    eval batches in the eval line, in TensorBoard (eval/samples_per_s, eval/loader_wait_s) and in
    summary.json (eval_samples_per_s, eval_loader_wait_s)."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summaries = {}
    for pipelined in (True, False):
        run = tmp_path / str(pipelined)
        assert _train(run, f"train.eval_pipelined={str(pipelined).lower()}") == 0
        lines = [line for line in capfd.readouterr().out.splitlines() if ": eval auc " in line]
        assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"], lines
        assert all(re.search(r" samples/s, \d+\.\d\d s of it waiting for batches\)$", line) for line in lines), lines
        summaries[pipelined] = json.loads((run / "summary.json").read_text())
        assert summaries[pipelined]["eval_samples_per_s"] > 0 and summaries[pipelined]["eval_loader_wait_s"] >= 0
        events = EventAccumulator(str(run)).Reload()
        assert [e.step for e in events.Scalars("eval/samples_per_s")] == [2, 4]
        assert [e.step for e in events.Scalars("eval/loader_wait_s")] == [2, 4]
    for key in ("eval_auc", "eval_ne", "eval_logloss", "eval_accuracy", "loss"):
        assert summaries[True][key] == summaries[False][key], (key, summaries)
