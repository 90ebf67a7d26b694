"""Models recpipe has never seen, whose batches keep their KeyedJaggedTensors anywhere,
train through every pipeline exactly like the plain loop (semi_sync: exactly like its
documented staleness). Two Gloo processes on CPU; see tests/model_zoo.py for the cases:
torchrec's TestSparseNN with ModelInput (weighted and unweighted tables, optionally a
feature processor), the two-tower example (dict of KJTs + EmbeddingCollection), a
dataclass batch with its KJT in ``ids``, and a model that builds its KJT inside forward
(pipelined through ``inputs=``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import model_zoo
from pipeline_harness import assert_differs, assert_same, expect_pipeline_error, small_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES, PipelineError
from recpipe.pipelines.defs import fused_sparse_dist
import schedule_variants as variants

CASES = {
    "TestSparseNN": model_zoo.sparse_nn,
    "TestSparseNN+fp": lambda: model_zoo.sparse_nn(feature_processor=True),
    "two-tower": model_zoo.two_tower,
    "dataclass-ids": model_zoo.ids_model,
    "concat-in-forward": lambda: model_zoo.ids_model(concat=True),
}


def _numerics_worker(cfg, case_name: str) -> None:
    init_process_group(cfg)
    case = CASES[case_name]()
    cpu = torch.device("cpu")
    batches = case.batches(dist.get_rank(), 6)
    reference = model_zoo.plain_loop(case, batches)
    runs = [("base", {}), ("sparse_dist", {}), ("prefetch", {}), ("sparse_dist", {"max_batches_ahead": 1})]
    if case.fused_ok:
        runs += [("fused_sparse_dist", {}), ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_OWN_STREAM}),
                 ("fused_sparse_dist", {"schedule": fused_sparse_dist.SCHEDULE_AFTER_OPTIMIZER})]
    for name, options in runs:
        assert_same(reference, model_zoo.run_pipeline(case, name, batches, **options), f"{case.name}: {name} {options}")
    # Drains between segments (eval / checkpoint points) change nothing.
    assert_same(reference, model_zoo.run_pipeline(case, "sparse_dist", batches, segments=[2, 1, 3]), f"{case.name}: segments")
    for start_batch, stash in [(0, False), (2, True)]:
        got = model_zoo.run_pipeline(case, "semi_sync", batches, start_batch=start_batch, stash_gradients=stash)
        want = model_zoo.semi_sync_reference(case, batches, start_batch, stash)
        assert_same(want, got, f"{case.name}: semi_sync start_batch={start_batch} stash={stash}")
        assert_differs(reference, got, f"{case.name}: semi_sync vs plain loop (staleness must be visible)")
    if not case.fused_ok:
        model, opt = case.build(cpu)
        try:
            PIPELINES["fused_sparse_dist"](model, opt, cpu)
        except PipelineError as err:
            assert "feature processors" in str(err), err
        else:
            raise AssertionError("fused_sparse_dist accepted a feature-processed module")
    dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("case_name", list(CASES))
def test_any_model_trains_like_the_plain_loop(case_name):
    launch_local(_numerics_worker, 2, small_config(), case_name)


def _describe_and_errors_worker(cfg) -> None:
    init_process_group(cfg)
    cpu = torch.device("cpu")
    rank = dist.get_rank()

    expect = expect_pipeline_error

    # Where each module's input comes from, as the pipeline shows it after the first batch.
    case = model_zoo.two_tower()
    model, opt = case.build(cpu)
    pipe = PIPELINES["sparse_dist"](model, opt, cpu)
    assert "learned on the first batch" in pipe.describe()
    pipe.progress(iter(case.batches(rank, 3)))
    assert pipe.describe().splitlines() == [
        "user_ebc <- batch.features['user']", "item_ebc <- batch.features['item']", "history_ec <- batch.history",
    ], pipe.describe()
    while True:  # drain
        try:
            pipe.progress(iter([]))
        except StopIteration:
            break

    concat = model_zoo.ids_model(concat=True)
    batches = concat.batches(rank, 3)
    model, opt = concat.build(cpu)
    # The model builds its KJT in forward and no inputs= function: the module and both fixes are named.
    expect(lambda: PIPELINES["sparse_dist"](model, opt, cpu).progress(iter(batches)),
           "'ebc'", "not in the batch", "KeyedJaggedTensors found: batch['ids']", "data loader", "inputs={'ebc': fn}")
    model, opt = concat.build(cpu)
    # A function that does not compute what the model passes: the field is named.
    expect(lambda: PIPELINES["fused_sparse_dist"](model, opt, cpu, inputs={"ebc": lambda b: b["ids"]}).progress(iter(batches)),
           "inputs['ebc']", "does not compute what the model passes", "keys ['a', 'b'] vs ['a', 'b', 'c']")
    expect(lambda: PIPELINES["sparse_dist"](model, opt, cpu, inputs={"sparse.nope": model_zoo.concat_ids}),
           "['sparse.nope']", "not sharded modules", "['ebc']")

    # A model that reads its input from another place after the first batch.
    from torchrec.distributed.model_parallel import get_unwrapped_module

    ids = model_zoo.ids_model()
    real_forward = model_zoo.IdsModel.forward

    def copy_after_first(self, batch):  # from the second call on, a copy of batch.ids reaches the module
        self.calls += 1
        if self.calls > 1:
            batch = model_zoo.IdsBatch(batch.dense, batch.ids.permute([0, 1]), batch.target)
        return real_forward(self, batch)

    model, opt = ids.build(cpu)
    user = get_unwrapped_module(model)
    user.calls, user.forward = 0, copy_after_first.__get__(user)
    expect(lambda: _train_all(PIPELINES["sparse_dist"](model, opt, cpu), ids.batches(rank, 4)),
           "'ebc'", "not batch.ids", "first batch")

    # Contracts: (loss, output) and Pipelineable batches.
    model, opt = ids.build(cpu)
    user = get_unwrapped_module(model)
    user.forward = (lambda self, b: real_forward(self, b)[0]).__get__(user)
    expect(lambda: PIPELINES["base"](model, opt, cpu).progress(iter(ids.batches(rank, 2))), "returns (loss, output)")
    model, opt = concat.build(cpu)
    plain = [dict(b) for b in batches]
    expect(lambda: PIPELINES["sparse_dist"](model, opt, cpu, inputs={"ebc": model_zoo.concat_ids}).progress(iter(plain)),
           "(dict) has no to method", "Pipelineable")


def _train_all(pipe, batches):
    it = iter(batches)
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            return


@pytest.mark.slow
def test_pipelines_describe_inputs_and_refuse_what_they_cannot_pipeline():
    launch_local(_describe_and_errors_worker, 2, small_config())
