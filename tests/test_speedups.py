"""Speed features are plug-ins: a toy one added the documented way (tests/toy_speedup.py:
one declaration module and one registry line) gets a config section on every pipeline, is
applied by the builder to a pipeline that offers what it needs, and is refused, by
capability, by the preflight and by the builder where a pipeline does not; and every
built-in feature asks for capabilities, never for pipeline names."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from recpipe.pipelines.registry import PIPELINES
from recpipe.speedups.registry import SPEEDUPS

HERE = Path(__file__).parent
ROOT = HERE.parent

# Runs in a fresh process: the registry line comes before recpipe.config, as a built-in's does.
SCRIPT = """
import torch
from torch import nn

import toy_speedup
from recpipe.speedups.registry import register
register(toy_speedup.FEATURE)

import toy_pipeline

from recpipe.builder import make_pipeline
from recpipe.config import ConfigError, load_config
from recpipe.errors import PipelineError
from recpipe.pipelines import register as register_pipeline
from recpipe.preflight import check_rules

register_pipeline(toy_pipeline.PIPELINE)


class Batch:
    def __init__(self, x):
        self.x = x

    def to(self, device, non_blocking=False):
        return Batch(self.x.to(device))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, batch):
        loss = self.linear(batch.x).pow(2).mean()
        return loss, loss.detach()


def pipeline(name):
    cfg = load_config(None, [f"pipeline.name={name}", "pipeline.step_counter=true", "train.device=cpu"])
    model = Model()
    return cfg, make_pipeline(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))


cfg, pipe = pipeline("base")
check_rules(cfg)
assert cfg.pipeline.step_counter.enabled and not load_config(None, []).pipeline.step_counter.enabled
(counter,) = pipe.applied
batches = iter([Batch(torch.randn(8, 4)) for _ in range(5)])
while True:
    try:
        pipe.progress(batches)
    except StopIteration:
        break
assert counter.steps == 5, counter
print("applied:", repr(counter))
try:
    check_rules(load_config(None, ["pipeline.name=copies_ahead", "pipeline.step_counter=true"]))
except ConfigError as err:
    print("preflight:", err)
try:
    pipeline("copies_ahead")
except PipelineError as err:
    print("builder:", err)
"""


def test_a_speed_feature_added_the_documented_way_is_applied_and_refused_by_capability():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=HERE,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "applied: step counter: 5 optimizer steps" in out.stdout, out.stdout
    assert ("preflight: invalid config: pipeline.step_counter needs one_batch_per_step (one batch's whole step runs "
            "in one call") in out.stdout, out.stdout
    assert "which pipeline.name='copies_ahead' does not offer; pipelines that do: base, sparse_dist" in out.stdout
    assert ("builder: pipeline.step_counter needs one_batch_per_step, which pipeline 'copies_ahead' does not offer"
            in out.stdout), out.stdout


def test_a_section_registered_after_the_config_is_imported_is_a_key_of_later_configs():
    """The pipelines' options are built from the sections registered when first needed: a
    feature registered after ``recpipe.config`` was imported (and configs were loaded) is a key
    of the configs loaded after it, and of those only; the built-in configs validate as
    before, their pipelines' keys in the same order, and pickle through their pipeline's class."""
    import pickle

    import pytest

    import toy_speedup
    from recpipe.config import ConfigError, load_config
    from recpipe.pipeline_options import options_of
    from recpipe.runtime.options import PipelineKeys
    from recpipe.speedups.registry import register, unregister

    configs = sorted((ROOT / "recpipe" / "configs").rglob("*.yaml"))
    before = {path: load_config(path) for path in configs}
    orders = {name: list(options_of(d).model_fields) for name, d in PIPELINES.items()}
    written = ["pipeline={name: sparse_dist, step_counter: true}"]
    with pytest.raises(ConfigError, match="step_counter"):
        load_config(None, written)
    register(toy_speedup.FEATURE)
    try:
        cfg = load_config(None, written)
        assert cfg.pipeline.step_counter.enabled and "step_counter" in cfg.pipeline.model_fields_set
        assert pickle.loads(pickle.dumps(cfg)) == cfg
        for name, d in PIPELINES.items():  # the new section after the others, the pipeline's own keys last
            fields = list(options_of(d).model_fields)
            common = len(PipelineKeys.model_fields) + sum(f.options is not None for f in SPEEDUPS.values()) - 1
            assert fields == orders[name][:common] + ["step_counter"] + orders[name][common:], name
        for path, old in before.items():
            new = load_config(path)
            assert new.pipeline.step_counter == toy_speedup.StepCounterOptions()
            dumped = new.model_dump()
            del dumped["pipeline"]["step_counter"]
            assert dumped == old.model_dump(), path
            assert pickle.loads(pickle.dumps(new)) == new, path
    finally:
        unregister(toy_speedup.FEATURE.name)
    with pytest.raises(ConfigError, match="step_counter"):
        load_config(None, written)
    assert {name: list(options_of(d).model_fields) for name, d in PIPELINES.items()} == orders


def test_speed_features_ask_for_capabilities_never_for_pipeline_names():
    """No speed feature's module (declaration or implementation) names a pipeline (a step may
    share a pipeline's name: the ``prefetch`` step), and every capability a feature needs is
    offered by some pipeline."""
    from recpipe.runtime.schedule import STEP_DOC

    names = set(PIPELINES) - set(STEP_DOC)
    for path in (ROOT / "recpipe" / "speedups").rglob("*.py"):
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & names, (path, strings & names)
    offered = set().union(*(d.offers for d in PIPELINES.values()))
    for feature in SPEEDUPS.values():
        assert feature.needs <= offered, feature.name


def test_the_planner_and_the_bench_read_a_features_facts_from_its_declaration():
    """What the memory planner (``plan_facts``) and the bench (``torchrec_note``,
    ``torchrec_run``) know of a speed feature is in its declaration: a feature registered
    with facts gets them in the plan's pipeline and in the bench's TorchRec runs."""
    import dataclasses

    import toy_speedup
    from recpipe.bench.run import BenchOptions
    from recpipe.bench.runner import runs_of
    from recpipe.config import load_config
    from recpipe.planner.spec import pipeline_spec
    from recpipe.speedups.registry import register, unregister

    smoke = ROOT / "recpipe" / "configs" / "bench" / "smoke_cpu.yaml"
    opts = BenchOptions(("sparse_dist",), True, 3, 1, 0, "unused")
    assert pipeline_spec(load_config(smoke, ["pipeline.cuda_graphs={enabled: true, modules: [a, b, c]}"])
                         .pipeline).graphed_parts == 3
    toy = dataclasses.replace(toy_speedup.FEATURE, plan_facts=lambda options: {"graphed_parts": 7},
                              torchrec_note="TorchRec counts nothing", torchrec_run="torchrec_counted")
    register(toy)
    try:
        for written, parts, runs in ((False, 0, [("sparse_dist", "recpipe"), ("sparse_dist", "torchrec")]),
                                     (True, 7, [("sparse_dist", "recpipe"), ("sparse_dist", "torchrec"),
                                                ("base", "torchrec_counted")])):
            cfg = load_config(smoke, [f"pipeline={{name: sparse_dist, step_counter: {str(written).lower()}}}"])
            assert pipeline_spec(cfg.pipeline).graphed_parts == parts
            assert runs_of(cfg, opts) == runs
        on_base = load_config(smoke, ["pipeline={name: fused_sparse_dist, step_counter: true}"])
        assert pipeline_spec(on_base.pipeline).graphed_parts == 0  # the pipeline lacks what it needs: not run
    finally:
        unregister(toy.name)
