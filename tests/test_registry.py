"""A pipeline is one module and one registry entry: a toy pipeline added the documented
way (tests/toy_pipeline.py, light, run by the shared engine) and one with an engine class
of its own, registered here, get config validation, a memory plan, ``recpipe schedule``
and training from that alone; and the facts the planner reads off each schedule are the
ones it always used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import assert_same, build, make_batches, small_config, train
from recpipe.cli import main
from recpipe.config import ConfigError, load_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES, Pipeline, PipelineDef, register, unregister
from recpipe.runtime.options import PipelineKeys
from recpipe.runtime.schedule import Schedule, Step, memory_facts
from recpipe.planner import plan_from_config
import schedule_variants as variants

TOY_SCHEDULE = Schedule(
    "toy",
    (
        Step("h2d", "memcpy", 2),
        Step("zero_grad", "compute", 0),
        Step("forward", "compute", 0, waits=(("h2d", 0),)),
        Step("backward", "compute", 0),
        Step("optimizer", "compute", 0),
    ),
    doc="A plain loop with its copies two batches ahead.",
).validate()


class ToyOptions(PipelineKeys):
    name: Literal["toy"]
    # Only to show that a pipeline's own keys are validated where it defines them.
    flavour: Literal["plain", "spicy"] = "plain"


class ToyPipeline(Pipeline):
    def __init__(self, model, optimizer, device, *, flavour: str = "plain", **options) -> None:
        self.flavour = flavour
        super().__init__(model, optimizer, device, **options)


TOY = PipelineDef("toy", ToyOptions, "a plain loop, copies two ahead", schedules=(TOY_SCHEDULE,),
                  schedule_of=lambda options: TOY_SCHEDULE, offers=frozenset(), engine="test_registry:ToyPipeline")


@pytest.fixture
def toy():
    register(TOY)
    try:
        yield TOY
    finally:
        unregister("toy")


def test_a_registered_pipeline_gets_config_plan_and_schedule(toy, capsys):
    cfg = load_config(None, ["pipeline.name=toy", "pipeline.flavour=spicy", "pipeline.max_batches_ahead=2"])
    assert isinstance(cfg.pipeline, ToyOptions) and cfg.pipeline.flavour == "spicy"
    with pytest.raises(ConfigError, match="pipeline.flavour"):
        load_config(None, ["pipeline.name=toy", "pipeline.flavour=bland"])
    with pytest.raises(ConfigError, match="pipeline.emb_lookup: unknown key; allowed here: .*flavour"):
        load_config(None, ["pipeline.name=toy", "pipeline.emb_lookup=before_update"])
    plan = plan_from_config(load_config(None, ["pipeline.name=toy", "distributed.nproc=2"]))
    assert plan.ranks[0].hbm_bytes > 0
    assert toy.memory(cfg.pipeline)["batches_in_flight"] == 3
    assert main(["schedule", "toy"]) == 0
    assert "copies two batches ahead" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already registered"):
        register(TOY)


def _toy_worker(cfg) -> None:
    register(TOY)
    init_process_group(cfg)
    batches = make_batches(cfg, 5, dist.get_rank())
    assert_same(train(cfg, "base", batches), train(cfg, "toy", batches, flavour="spicy"), "toy pipeline")


@pytest.mark.slow
def test_a_registered_pipeline_trains(toy):
    launch_local(_toy_worker, 2, small_config(2))


@pytest.fixture
def copies_ahead():
    import toy_pipeline

    register(toy_pipeline.PIPELINE)
    try:
        yield toy_pipeline.PIPELINE
    finally:
        unregister("copies_ahead")


def test_a_pipeline_added_the_documented_way_is_one_light_module(copies_ahead, capsys):
    """docs/architecture.md's recipe: one module that imports nothing heavy, one registry line;
    the shared engine runs it."""
    code = ("import sys, toy_pipeline; heavy = sorted(m for m in ('torch', 'torchrec', 'fbgemm_gpu') if m in sys.modules); "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
    cfg = load_config(None, ["pipeline.name=copies_ahead"])
    with pytest.raises(ConfigError, match="pipeline.flavour: unknown key"):
        load_config(None, ["pipeline.name=copies_ahead", "pipeline.flavour=spicy"])
    assert copies_ahead.engine_class() is Pipeline and not copies_ahead.intercepts
    assert copies_ahead.memory(cfg.pipeline)["batches_in_flight"] == 3
    assert plan_from_config(load_config(None, ["pipeline.name=copies_ahead", "distributed.nproc=2"])).ranks[0].hbm_bytes
    assert main(["schedule", "copies_ahead"]) == 0
    assert "copies two batches ahead" in capsys.readouterr().out


def _copies_ahead_worker(cfg) -> None:
    import toy_pipeline

    register(toy_pipeline.PIPELINE)
    init_process_group(cfg)
    batches = make_batches(cfg, 5, dist.get_rank())
    assert_same(train(cfg, "base", batches), train(cfg, "copies_ahead", batches), "copies_ahead pipeline")


@pytest.mark.slow
def test_a_pipeline_added_the_documented_way_trains(copies_ahead):
    launch_local(_copies_ahead_worker, 2, small_config(2))


# The planner's facts of every schedule, as they were stated by hand before they were read
# off the tables (batches in flight, received KJTs alive, sent KJTs pending, side streams,
# lookup stream, early lookups, dense backward first, kept embedding graph).
STATED = {
    "base": (2, 1, 0, ("memcpy",), "main", False, False, False, False, False),
    "sparse_dist": (3, 2, 1, ("memcpy", "dist"), "main", False, False, False, False, False),
    "fused_sparse_dist": (3, 2, 1, ("memcpy", "dist"), "main", False, False, True, True, False),
    "fused_sparse_dist_lookup_after_optimizer": (3, 2, 1, ("memcpy", "dist"), "main", False, False, True, True, False),
    "fused_sparse_dist_lookup_on_dist": (3, 2, 1, ("memcpy", "dist"), "dist", False, False, True, True, False),
    "fused_sparse_dist_lookup_on_own_stream": (3, 2, 1, ("memcpy", "dist", "lookup"), "lookup", False, False, True,
                                               True, False),
    "semi_sync": (3, 3, 1, ("memcpy", "dist"), "main", True, False, False, True, True),
    "semi_sync_wait_early": (3, 3, 1, ("memcpy", "dist"), "main", True, False, False, True, True),
    "semi_sync_before_update": (3, 3, 1, ("memcpy", "dist"), "main", False, True, False, True, False),
    "semi_sync_before_update_wait_early": (3, 3, 1, ("memcpy", "dist"), "main", False, True, False, True, False),
    "prefetch": (3, 2, 0, ("memcpy", "dist", "prefetch"), "main", False, False, False, False, False),
    "prefetch_wait_before_forward": (3, 2, 0, ("memcpy", "dist", "prefetch"), "main", False, False, False, False,
                                     False),
    "prefetch_early_splits": (3, 2, 1, ("memcpy", "dist", "prefetch"), "main", False, False, False, False, False),
}
FIELDS = ("batches_in_flight", "dist_kjts_in_flight", "pending_input_dists", "side_streams", "lookup_stream",
          "early_pooled", "early_pooled_at_update", "lookup_after_backward", "dense_backward_first", "keeps_emb_graph")


def test_memory_facts_read_off_the_schedules_are_the_stated_ones():
    schedules = {s.name: s for d in PIPELINES.values() for s in d.schedules}
    schedules.update({s.name: s for group in variants.VARIANTS.values() for s in group})
    checked = {name: s for name, s in schedules.items() if not name.endswith("_warmup")}
    assert set(checked) == set(STATED), sorted(set(checked) ^ set(STATED))
    for name, schedule in checked.items():
        facts = memory_facts(schedule)
        assert tuple(facts[f] for f in FIELDS) == STATED[name], (name, facts)


def test_make_pipeline_builds_a_subclass_of_the_configured_pipeline_only():
    """A trainer script's hooks: ``cls`` must subclass the class of ``pipeline.name``."""
    from recpipe.builder import make_pipeline
    from recpipe.config import load_config
    from recpipe.errors import PipelineError
    from recpipe.pipelines import PIPELINES

    cfg = load_config(None, ["pipeline.name=sparse_dist"])
    with pytest.raises(PipelineError, match="not a subclass of SparseDistPipeline"):
        make_pipeline(cfg, None, None, torch.device("cpu"), cls=PIPELINES["base"].engine_class())
