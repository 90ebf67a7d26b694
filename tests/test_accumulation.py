"""``train.accumulate_steps``: N micro-batches per optimizer step train as one batch of
N x ``data.batch_size`` for the dense part (up to float summation order), and the fused
embedding tables as documented in ``recpipe.pipelines.accumulation``. Gloo on CPU, 1 and 2 ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipeline_harness import RunResult, build, local_state, make, make_batches, small_config, train
from recpipe.data.batch import Batch
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines.accumulation import GradientAccumulation

N = 2  # micro-batches per optimizer step
STEPS = 3  # optimizer steps
# Summation order: a weight gradient is one sum over N x B rows in the large batch and N sums
# of B rows here, and on two ranks each micro-batch's all-reduce adds the ranks' running sums:
# float32 rounding. The optimizers are SGD, whose update is linear in the gradient: Adagrad's
# g / sqrt(sum g^2) passes a rounding difference on in full where an element's gradient nearly
# cancels (measured with it: 9e-5 on one of 208 weights, 2 ranks, updates of 0.3).
RTOL, ATOL = 1e-5, 1e-6
SGD = ["optimizer.embedding.name=sgd", "optimizer.dense.name=sgd"]
FUSED = ("t_cat_0", "t_cat_1", "t_cat_2")  # default fused (table_wise), row_wise, column_wise
DENSE_OPTIMIZED = ("dense_arch", "over_arch", "t_cat_3")  # the dense modules and the data_parallel table
SYNCHRONOUS = ["base", "sparse_dist", "fused_sparse_dist", "prefetch"]


def micro_batches(cfg, rank: int, disjoint: bool) -> list[Batch]:
    """STEPS x N micro-batches; ``disjoint``: micro-batch k of a step reads only rows of the
    k-th N-th of every table, so no row is read by two micro-batches of one step."""
    batches = make_batches(cfg, STEPS * N, rank)
    if not disjoint:
        return batches
    out = []
    for i, b in enumerate(batches):
        k, kjt = i % N, b.sparse_features
        values = []
        for key, rows in zip(kjt.keys(), cfg.model.num_embeddings_per_feature):
            band = rows // N
            values.append(kjt[key].values() % band + k * band)
        out.append(Batch(b.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=kjt.lengths()),
                         b.labels, b.weights))
    return out


def concat(batches: list[Batch]) -> Batch:
    """One batch of all the samples of ``batches``, in order."""
    keys = batches[0].sparse_features.keys()
    parts = [b.sparse_features.to_dict() for b in batches]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat([p[k].values() for k in keys for p in parts]),
                            lengths=torch.cat([p[k].lengths() for k in keys for p in parts]))
    return Batch(torch.cat([b.dense_features for b in batches]), kjt,
                 torch.cat([b.labels for b in batches]), torch.cat([b.weights for b in batches]))


def accumulated(cfg, name: str, batches: list[Batch], steps: int = N, segments: list[int] | None = None,
                device: torch.device = torch.device("cpu"), compiled: bool = False, **options) -> RunResult:
    """Train ``batches`` through pipeline ``name`` with ``steps`` micro-batches per optimizer
    step; ``segments``: micro-batches per pass (each ends in a drain), as the trainer's;
    ``compiled``: the dense modules compiled (``pipeline.compile``); ``options``: the harness's
    speed features (``cuda_graphs=True``)."""
    sm = build(cfg, device)
    if compiled:
        from recpipe.speedups.compile import CompileOptions, apply_compile

        apply_compile(sm.model, CompileOptions(enabled=True))
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    acc = GradientAccumulation(make(name, sm, device, **options), steps)
    losses, it = [], iter(batches)
    for size in segments or [len(batches)]:
        seg = itertools.islice(it, size)
        while True:
            try:
                trained = acc.step(seg)
            except StopIteration:
                break
            losses.append(torch.stack([loss for _, loss, _ in trained]).mean())
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return RunResult([x.cpu() for x in losses], [], {k: v.cpu() for k, v in local_state(sm.model).items()})


def compare(a: RunResult, b: RunResult, part: tuple[str, ...]) -> float:
    """Largest absolute difference of the tensors of ``part`` (key substrings)."""
    keys = [k for k in a.state if any(p in k for p in part)]
    assert keys, part
    return max((a.state[k] - b.state[k]).abs().max().item() for k in keys)


def assert_close(a: RunResult, b: RunResult, part: tuple[str, ...], what: str) -> None:
    for key in (k for k in a.state if any(p in k for p in part)):
        torch.testing.assert_close(a.state[key], b.state[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}, {key}: {m}")


def all_data_parallel(cfg):
    """``cfg`` with every table data_parallel (updated by the dense optimizer)."""
    return cfg.model_copy(update={"sharding": cfg.sharding.model_copy(update={
        "tables": {name: cfg.sharding.tables["t_cat_3"] for name in cfg.model.table_names}})})


def _check(cfg, disjoint: bool, fused: bool) -> None:
    """The accumulated runs of every synchronous pipeline against one large batch."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    large = cfg.model_copy(update={"data": cfg.data.model_copy(update={"batch_size": N * cfg.data.batch_size})})
    micro = micro_batches(cfg, rank, disjoint)
    reference = train(large, "base", [concat(micro[i:i + N]) for i in range(0, len(micro), N)])
    plain = train(cfg, "base", micro)  # the same micro-batches, one optimizer step each
    init = RunResult([], [], local_state(build(cfg, torch.device("cpu")).model))
    for name in SYNCHRONOUS:
        got = accumulated(cfg, name, micro)
        what = f"{name}, {'fused' if fused else 'data_parallel'} tables, {'disjoint' if disjoint else 'shared'} rows, {ranks} rank(s)"
        assert compare(plain, got, DENSE_OPTIMIZED) > 100 * ATOL, f"{what}: one step per micro-batch"
        if fused and not disjoint:
            # a later micro-batch reads rows an earlier one updated: the tables differ, and
            # through them the dense gradients (only the first micro-batch's loss is equal)
            torch.testing.assert_close(reference.losses[0], got.losses[0], rtol=RTOL, atol=ATOL)
            # by more than 1e-4 of the large batch's own update of the tables (disjoint rows: under 1e-5)
            assert compare(reference, got, FUSED) > 1e-4 * compare(reference, init, FUSED), what
        else:
            for x, y in zip(reference.losses, got.losses):  # the large batch's mean loss
                torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)
            assert_close(reference, got, ("",), what)  # every tensor of the model
        if rank == 0 and name == "base":
            fused_diff = compare(reference, got, FUSED) if fused else 0.0
            print(f"{what}: max |dense - large| {compare(reference, got, DENSE_OPTIMIZED):.3g} "
                  f"(update {compare(reference, init, DENSE_OPTIMIZED):.3g}), max |fused tables - large| "
                  f"{fused_diff:.3g} (update {compare(reference, init, FUSED) if fused else 0.0:.3g})")


def _equals_large_batch_worker(cfg) -> None:
    init_process_group(cfg)
    _check(all_data_parallel(cfg), disjoint=False, fused=False)
    _check(cfg, disjoint=True, fused=True)
    _check(cfg, disjoint=False, fused=True)


@pytest.mark.parametrize("nproc", [1, 2])
def test_accumulated_micro_batches_train_as_one_large_batch(nproc):
    launch_local(_equals_large_batch_worker, nproc, small_config(nproc, SGD))


def _short_step_worker(cfg) -> None:
    """Drains inside a step: data that ends after k < N micro-batches ends the step on their
    mean gradient, as a last batch of k x B samples would; segment ends at step
    boundaries change nothing. Every table data_parallel: the whole model is compared."""
    init_process_group(cfg)
    cfg = all_data_parallel(cfg)
    micro = micro_batches(cfg, dist.get_rank(), disjoint=False)
    ref = accumulated(cfg, "sparse_dist", micro, steps=3)  # 6 micro-batches: two steps of 3
    segmented = accumulated(cfg, "sparse_dist", micro, steps=3, segments=[3, 3])
    for key in ref.state:
        assert torch.equal(ref.state[key], segmented.state[key]), key
    large = cfg.model_copy(update={"data": cfg.data.model_copy(update={"batch_size": 3 * cfg.data.batch_size})})
    # 5 micro-batches: a step of 3, then a short step of 2 (a last batch of 2 x B samples)
    short = accumulated(cfg, "sparse_dist", micro[:5], steps=3)
    reference = train(large, "base", [concat(micro[0:3]), concat(micro[3:5])])
    assert len(short.losses) == 2
    assert_close(reference, short, ("",), "short last step")


def test_data_ending_inside_a_step_steps_on_the_mean_of_its_micro_batches():
    launch_local(_short_step_worker, 2, small_config(2, SGD))


def test_semi_sync_is_refused():
    from recpipe.errors import PipelineError

    class Fake:
        name = "semi_sync"

        @staticmethod
        def schedules():
            from recpipe.pipelines.defs.semi_sync import PIPELINE

            return list(PIPELINE.schedules)

    with pytest.raises(PipelineError, match="splits them"):
        GradientAccumulation(Fake(), 2)


# ------------------------------------------------------------------ recpipe train
STEPS_PER_EPOCH = 3  # 5 batches an epoch in steps of 2: 2, 2 and a short step of 1


def _run(tmp_path, run: str, steps: int, every: int, extra: tuple[str, ...] = ()) -> int:
    from pathlib import Path

    from recpipe.cli import main
    from test_checkpoint import TINY

    overrides = [o for o in TINY if not o.startswith(("data.synthetic.num_batches", "train.epochs"))] + [
        "data.synthetic.num_batches=5", "train.epochs=2", "train.accumulate_steps=2", "train.log_every=1",
        f"train.steps={steps}", f"checkpoint.dir={tmp_path / run / 'ckpt'}", f"checkpoint.every={every}",
        "checkpoint.keep=1", f"logging.run_dir={tmp_path / run}", *extra]
    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    return main(["train", "--config", str(config), *(a for pair in overrides for a in ("--set", pair))])


@pytest.mark.slow
def test_train_counts_optimizer_steps_and_resumes_exactly(tmp_path, capfd):
    """``recpipe train`` with train.accumulate_steps=2: train.steps and checkpoint.every count
    optimizer steps (a checkpoint is never inside one), an epoch's data that ends inside a
    step ends it, and a resume trains bit for bit as the uninterrupted run."""
    import json

    from test_checkpoint import _full_state

    from recpipe.checkpoint.store import METADATA_FILE

    total = 2 * STEPS_PER_EPOCH
    assert _run(tmp_path, "straight", total, 0) == 0
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert (summary["steps"], summary["epoch"]) == (total, 2)
    assert summary["samples"] == total * 2 * 64 * 2  # steps x micro-batches x data.batch_size x ranks
    assert _run(tmp_path, "resumed", 4, 4) == 0  # step 4: epoch 1 after 2 batches
    meta = json.loads((tmp_path / "resumed" / "ckpt" / "step_00000004" / METADATA_FILE).read_text())
    assert (meta["step"], meta["epoch"], meta["batch"]) == (4, 1, 2)
    assert _run(tmp_path, "resumed", total, 4) == 0
    assert "resumed from" in capfd.readouterr().out
    a = _full_state(tmp_path / "straight" / "ckpt" / f"step_{total:08d}", tmp_path)
    b = _full_state(tmp_path / "resumed" / "ckpt" / f"step_{total:08d}", tmp_path)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, different


@pytest.mark.parametrize("override, needle", [
    ("pipeline={name: semi_sync}", "pipeline.name='semi_sync' splits"),
    ("pipeline={name: sparse_dist, step_graph: true}", "pipeline.step_graph replays"),
    ("pipeline={name: sparse_dist, cuda_graphs: true}", "pipeline.cuda_graphs: micro-batches"),
    ("train.on_nonfinite=skip_step", "train.on_nonfinite=skip_step skips"),
])
def test_what_accumulation_cannot_run_with_exits_2(override, needle, capsys):
    from recpipe.cli import main

    from pathlib import Path

    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    assert main(["train", "--config", str(config), "--set", "train.accumulate_steps=2", "--set", override]) == 2
    err = capsys.readouterr().err
    assert "train.accumulate_steps=2" in err and needle in err, err


def test_a_stop_request_ends_the_optimizer_step_it_came_in_whole():
    """The agreed stop is checked before each batch is read; with accumulation the data
    goes on to the end of the step's micro-batches, so a preemption checkpoint is never
    inside a step (and its resume is exact, as above)."""
    from recpipe.train.preemption import Preemption

    for every, expected in ((1, [0, 1, 2, 3]), (3, [0, 1, 2, 3, 4, 5])):
        stop = Preemption.__new__(Preemption)  # its agreement needs a process group; only the flag is read
        stop.signum = None
        read = []
        for batch in stop.gate(range(10), every=every):
            read.append(batch)
            if batch == 3:  # agreed after batch 3
                stop.signum = 15
        assert read == expected, every
