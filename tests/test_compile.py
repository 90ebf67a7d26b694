"""``pipeline.compile`` on CPU (inductor's C++ backend): the dense modules are compiled
once, never again after the first steps, run the module's own forward outside training
and for other shapes, and train to the eager numbers up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import build, make_batches, small_config
from recpipe.config import ConfigError, load_config
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
from recpipe.pipelines import PIPELINES
from recpipe.speedups.compile import CompileOptions, CompiledForward, apply_compile

TABLES = ["sharding.tables={t_cat_1: {type: table_wise}}", "data.batch_size=32"]


def _steps(cfg, batches, compiled: bool):
    sm = build(cfg, torch.device("cpu"))
    applied = apply_compile(sm.model, CompileOptions(enabled=True)) if compiled else None
    pipe = PIPELINES["sparse_dist"](sm.model, sm.optimizer, torch.device("cpu"))
    losses, compiles = [], []
    it = iter(batches)
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            break
        losses.append(pipe.last_loss.clone())
        compiles.append(applied.compiles if applied else 0)
    return sm, pipe, applied, torch.stack(losses), compiles


def _worker(cfg) -> None:
    init_process_group(cfg)
    batches = make_batches(cfg, 6, dist.get_rank())
    _, _, _, eager, _ = _steps(cfg, batches, compiled=False)
    sm, pipe, applied, compiled, compiles = _steps(cfg, batches, compiled=True)
    # dense arch and head: a forward and a backward graph each, compiled at the first step only
    assert compiles[0] > 0 and compiles == [compiles[0]] * len(compiles), compiles
    assert torch.allclose(eager, compiled, rtol=1e-4, atol=1e-6), (eager, compiled)
    forwards = {f.name: f for f in applied.forwards}
    assert set(forwards) == {"dense_arch", "head"} and all(f.compiled_calls == 6 for f in forwards.values())
    # evaluation, and a batch of another size: the module's own forward, nothing compiled
    with torch.no_grad(), pipe.detached():
        sm.model.eval()
        sm.model(batches[0])
        sm.model.train()
    with pytest.warns(UserWarning, match="compiled for other input shapes"), pipe.detached():
        small = make_batches(cfg.model_copy(update={"data": cfg.data.model_copy(update={"batch_size": 8})}), 1,
                             dist.get_rank())[0]
        loss, _ = sm.model(small)
        loss.backward()
    assert applied.compiles == compiles[-1] and forwards["head"].eager_calls == 1
    assert "CompiledForward('head'" in repr(applied)
    # what summary.json reports under speedups.compile
    assert applied.summary() == {"dense_arch": {"compiled_calls": 6, "eager_calls": 1},
                                 "head": {"compiled_calls": 6, "eager_calls": 1}}
    applied.remove()
    assert not any(isinstance(vars(m).get("forward"), CompiledForward) for m in sm.model.modules())


@pytest.mark.slow
def test_compiled_dense_modules_compile_once_and_train_like_eager():
    launch_local(_worker, 1, small_config(1, TABLES))


def test_compile_section():
    cfg = load_config(None, ["pipeline.name=sparse_dist", "pipeline.compile=true"])
    assert cfg.pipeline.compile.enabled and cfg.pipeline.compile.mode == "default"
    assert cfg.pipeline.compile.deterministic
    assert cfg.pipeline.compile.inductor_options() == {"deterministic": True}
    cfg = load_config(None, ["pipeline.name=sparse_dist", "pipeline.compile={enabled: true, modules: [model.over_arch],"
                             " mode: max-autotune-no-cudagraphs, deterministic: false}"])
    assert cfg.pipeline.compile.modules == ["model.over_arch"]
    assert cfg.pipeline.compile.inductor_options() == {"max_autotune": True, "coordinate_descent_tuning": True,
                                                       "deterministic": False}


def test_timed_kernel_choices_need_deterministic_off():
    with pytest.raises(ConfigError, match=r"pipeline.compile.deterministic=false"):
        load_config(None, ["pipeline.name=sparse_dist",
                           "pipeline.compile={enabled: true, mode: max-autotune-no-cudagraphs}"])
