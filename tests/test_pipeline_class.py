"""``pipeline.class``: a user's subclass of a recpipe pipeline, trained by ``recpipe train``
with the configured options, on 2 ranks (Gloo), with evaluation, checkpoints and a resume;
a class that is not a subclass of the configured pipeline's, or that does not import, is a
config error (exit 2) before any process starts. And the trainer script's way,
``recpipe.train.train(cfg, pipeline_class=...)``, names a script's class by module."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from recpipe.callables import class_spec
from recpipe.cli import main
from recpipe.config import ConfigError
from recpipe.exit_codes import EXIT_BAD_CONFIG

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
SMALL = ["pipeline.name=sparse_dist", "pipeline.class=custom_pipelines:CountingSparseDist",
         "pipeline.max_batches_ahead=1", "data.batch_size=64", "data.synthetic.num_eval_batches=2",
         "train.eval_every=3", "train.log_every=3", "train.progress=false", "distributed.nproc=2"]


def _train(run: Path, steps: int, *extra: str) -> int:
    args = ["train", "--config", str(CONFIG)]
    for pair in [*SMALL, f"train.steps={steps}", f"checkpoint.dir={run / 'ckpt'}", "checkpoint.every=3",
                 f"logging.run_dir={run}", *extra]:
        args += ["--set", pair]
    return main(args)


def _counted(out: str) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for rank, step, schedule, ahead in re.findall(r"counted rank (\d) step (\d+) \(schedule (\w+), "
                                                   r"max_batches_ahead (\w+)\)", out):
        assert (schedule, ahead) == ("sparse_dist", "1"), (schedule, ahead)  # the configured options
        steps.setdefault(int(rank), []).append(int(step))
    return steps


@pytest.mark.slow
def test_recpipe_train_trains_the_configured_class_on_two_ranks_evaluates_saves_and_resumes(tmp_path, capfd,
                                                                                            monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the class's module: importable in every rank
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert _train(run, steps=6) == 0
    out = capfd.readouterr().out
    assert _counted(out) == {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6]}, out[-3000:]
    assert "step 3: eval auc" in out and "step 6: eval auc" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["status"] == "completed" and summary["eval_auc"] is not None
    assert summary["world_size"] == 2 and summary["pipeline"] == "sparse_dist"
    assert sorted(p.name for p in (run / "ckpt").glob("step_*")) == ["step_00000003", "step_00000006"]
    assert list(run.glob("events.out.tfevents.*"))  # TensorBoard
    assert "pipeline:\n  name: sparse_dist\n  class: custom_pipelines:CountingSparseDist" in (run / "config.yaml").read_text()
    # resumed from step 6: a new pipeline of the class trains steps 7 and 8 only
    assert _train(run, steps=8) == 0
    out = capfd.readouterr().out
    assert "resumed from" in out and _counted(out) == {0: [1, 2], 1: [1, 2]}, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from_step"] == 6 and summary["eval_auc"] is not None


@pytest.mark.parametrize("overrides,message", [
    (["pipeline.name=fused_sparse_dist"],
     "pipeline.class='custom_pipelines:CountingSparseDist' is class CountingSparseDist, whose bases are "
     "SparseDistPipeline, Pipeline, not a subclass of FusedSparseDistPipeline, the class of "
     "pipeline.name='fused_sparse_dist'"),
    (["pipeline.class=custom_pipelines:not_a_class"], "is a function, not a subclass of SparseDistPipeline"),
    (["pipeline.class=custom_pipelines:Nope"], "module 'custom_pipelines'"),
    (["pipeline.class=no_such_module:Cls"], "cannot import module 'no_such_module'"),
    (["pipeline.class=custom_pipelines.CountingSparseDist"], "expected 'package.module:function'"),
])
def test_a_class_recpipe_cannot_train_is_a_config_error_before_any_process_starts(overrides, message, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.chdir(tmp_path)
    assert _train(tmp_path / "run", 3, *overrides) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert message in err and "pipeline.class" in err, err
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_scripts_class_is_named_by_the_scripts_module(monkeypatch):
    """``train(cfg, pipeline_class=...)`` from a script: the ranks import the class by the
    script's module name (``scripts/x.py`` run from the repository root: ``scripts.x``), never
    by ``__main__``."""
    import types

    script = types.ModuleType("__main__")
    script.__file__ = str(ROOT / "scripts" / "custom_pipeline.py")
    script.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.chdir(ROOT)
    cls = type("ClippedSparseDist", (), {"__module__": "__main__"})
    assert class_spec(cls) == "scripts.custom_pipeline:ClippedSparseDist"
    script.__spec__ = types.SimpleNamespace(name="scripts.custom_pipeline")  # python -m scripts.custom_pipeline
    assert class_spec(cls) == "scripts.custom_pipeline:ClippedSparseDist"

    def local():
        class Inner:
            pass

        return Inner

    with pytest.raises(ConfigError, match="defined inside a function"):
        class_spec(local())
