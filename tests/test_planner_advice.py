"""A planner that advises (recpipe/planner/advice.py): for a plan that does not fit,
``recpipe plan`` names the cheapest changes that make it fit with the memory each frees,
and each is checked here by planning the changed config again through the command line
(``recpipe plan --set ...`` exits 0). ``sharding.placement: planner`` on CPU is a config
error naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recpipe.cli import main
from recpipe.config import load_config
from recpipe.exit_codes import EXIT_BAD_CONFIG, EXIT_DOES_NOT_FIT, EXIT_OK
from recpipe.planner import plan_from_config
from recpipe.preflight import Machine, check_memory
from recpipe.planner.advice import advise
from recpipe.planner.plan import fmt_bytes

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "configs" / "dlrm_gpu.yaml"
GPU = ["train.device=cuda", "sharding.hbm_gib=80", "sharding.tables={}", "distributed.nproc=8"]
# A 200M-row table (95 GiB of fp32 weights) table_wise on one of 8 GPUs of 80 GiB.
BIG = [*GPU, "model.num_embeddings_per_feature=[200000000, 5000000, 3000000, 1000000, 100000, 10000]"]
# Twelve tables of 40M rows (19 GiB each) table_wise over 2 GPUs: six on each rank.
MANY = [*GPU, "distributed.nproc=2", f"model.num_embeddings_per_feature={[40_000_000] * 12}"]


def _plan(overrides: list[str], capsys) -> tuple[int, str, str]:
    code = main(["plan", "--config", str(BASE), *[a for o in overrides for a in ("--set", o)]])
    out = capsys.readouterr()
    return code, out.out, out.err


def _sets(advice) -> list[str]:
    return [f"{key}={value}" for key, value in advice.overrides.items()]


def test_a_table_too_big_for_a_gpu_gets_row_wise_fp16_and_a_cache_each_checked_by_replanning(capsys):
    cfg = load_config(BASE, BIG)
    before = plan_from_config(cfg)
    assert not before.fits
    advice = advise(cfg)
    assert [a.kind for a in advice] == ["row_wise", "fp16", "uvm_cache"]  # cheapest first; no rank count helps
    for a in advice:
        assert list(a.overrides) == [k for k in a.overrides if k.startswith("sharding.tables.t_cat_0.")], a  # one table
        code, _, err = _plan(BIG + _sets(a), capsys)  # the changed config, planned again
        assert code == EXIT_OK, (a.what, err)
        after = plan_from_config(load_config(BASE, BIG + _sets(a)))
        peak = max(r.hbm_bytes for r in before.ranks) - max(r.hbm_bytes for r in after.ranks)
        assert a.frees_bytes == peak > 0, a
    row_wise, fp16, cache = advice
    assert row_wise.overrides == {"sharding.tables.t_cat_0.type": "row_wise"}
    assert fp16.overrides == {"sharding.tables.t_cat_0.weights_precision": "fp16"}
    load_factor = cache.overrides["sharding.tables.t_cat_0.cache_load_factor"]
    assert cache.overrides["sharding.tables.t_cat_0.kernel"] == "fused_uvm_caching" and 0 < load_factor < 1
    # the largest load factor: a hundredth more does not fit
    more = load_config(BASE, BIG + [f"sharding.tables.t_cat_0.kernel=fused_uvm_caching",
                                    f"sharding.tables.t_cat_0.cache_load_factor={load_factor + 0.01:.2f}"])
    assert not plan_from_config(more).fits

    code, _, err = _plan(BIG, capsys)
    assert code == EXIT_DOES_NOT_FIT
    peak = fmt_bytes(max(r.hbm_bytes for r in before.ranks))
    assert f"rank 0 needs {peak} of GPU memory but has 80.00 GiB" in err
    assert "to fit, each checked by planning the changed config (cheapest first):" in err
    assert f"1. row_wise over the 8 ranks for t_cat_0 (1 table): the most a rank needs drops from {peak}" in err
    assert "--set sharding.tables.t_cat_0.type=row_wise" in err and "host memory" in err


def test_more_ranks_and_the_fewest_tables_are_named(capsys):
    cfg = load_config(BASE, MANY)
    advice = {a.kind: a for a in advise(cfg)}
    assert list(advice) == ["fp16", "uvm_cache", "row_wise_ranks", "more_ranks"]
    # row_wise is not named: 228 GiB of tables over 2 ranks of 80 GiB do not fit however split
    all_row_wise = [f"sharding.tables.t_cat_{i}.type=row_wise" for i in range(12)]
    assert not plan_from_config(load_config(BASE, MANY + all_row_wise)).fits
    ranks = advice["more_ranks"].overrides["distributed.nproc"]
    assert ranks > 2 and plan_from_config(load_config(BASE, MANY + [f"distributed.nproc={ranks}"])).fits
    assert not plan_from_config(load_config(BASE, MANY + [f"distributed.nproc={ranks - 1}"])).fits  # the fewest
    # fp16 on fewer tables than all twelve, and one table fewer does not fit
    halved = [k.split(".")[2] for k in advice["fp16"].overrides]
    assert 0 < len(halved) < 12
    fewer = [f"sharding.tables.{t}.weights_precision=fp16" for t in halved[:-1]]
    assert not plan_from_config(load_config(BASE, MANY + fewer)).fits
    for a in advice.values():
        assert _plan(MANY + _sets(a), capsys)[0] == EXIT_OK, a.what
    code = main(["plan", "--config", str(BASE), "--format", "json", *[a for o in MANY for a in ("--set", o)]])
    doc = json.loads(capsys.readouterr().out)
    assert code == EXIT_DOES_NOT_FIT
    assert [a["kind"] for a in doc["advice"]] == ["fp16", "uvm_cache", "row_wise_ranks", "more_ranks"]
    assert all(a["peak_hbm_bytes_after"] <= a["capacity_bytes"] < a["peak_hbm_bytes_before"] for a in doc["advice"])


def test_a_plan_that_fits_gets_no_advice_and_one_nothing_helps_says_so(capsys):
    assert advise(load_config(BASE, GPU)) == []
    tiny = [*BIG, "sharding.hbm_gib=1"]  # even the smallest share of every change is too big
    assert advise(load_config(BASE, tiny)) == []
    code, _, err = _plan(tiny, capsys)
    assert code == EXIT_DOES_NOT_FIT and "no single change recpipe tries makes it fit" in err


def test_the_trainers_refusal_names_the_changes_too():
    lines: list[str] = []
    assert check_memory(load_config(BASE, BIG), Machine(cuda=True), log=lines.append,
                        refusal=lines.append) == EXIT_DOES_NOT_FIT
    assert "refusing to start" in lines[-1] and "--set sharding.tables.t_cat_0.type=row_wise" in lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_placement_planner_on_cpu_is_a_config_error_naming_the_key(tmp_path, capsys):
    code = main(["train", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--set", "sharding.placement=planner",
                 "--set", f"logging.run_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_CONFIG, err
    assert "sharding.placement='planner' places shards by their GPU memory" in err
    assert "use sharding.placement=config" in err and "Traceback" not in err


# One GPU of 80 GiB and a 400M-row table (191 GiB of fp32 weights): about 2.5 times what it holds.
ONE = [*GPU, "distributed.nproc=1", "model.num_embeddings_per_feature=[400000000, 5000000, 3000000, 1000000, 100000, 10000]"]


def test_a_table_too_big_for_one_gpu_gets_row_wise_over_the_fewest_gpus_that_fit(capsys):
    cfg = load_config(BASE, ONE)
    before = plan_from_config(cfg)
    peak = max(r.hbm_bytes for r in before.ranks)
    assert 2.3 < peak / before.ranks[0].capacity_bytes < 2.7
    advice = {a.kind: a for a in advise(cfg)}
    assert "row_wise" not in advice  # one rank: nothing to split over
    spread = advice["row_wise_ranks"]
    ranks = spread.overrides["distributed.nproc"]
    assert spread.overrides == {"distributed.nproc": ranks, "sharding.tables.t_cat_0.type": "row_wise"}
    split = [f"distributed.nproc={ranks}", "sharding.tables.t_cat_0.type=row_wise"]
    assert plan_from_config(load_config(BASE, ONE + split)).fits  # the planner's own estimate at N ranks
    fewer = [f"distributed.nproc={ranks - 1}", "sharding.tables.t_cat_0.type=row_wise"]
    assert not plan_from_config(load_config(BASE, ONE + fewer)).fits  # and not at N - 1
    assert ranks == 3
    code, _, err = _plan(ONE + _sets(spread), capsys)
    assert code == EXIT_OK, err
    code, _, err = _plan(ONE, capsys)
    assert code == EXIT_DOES_NOT_FIT
    assert (f"row_wise over 3 GPUs (distributed.nproc 1 -> 3) for t_cat_0 (1 table): the most a rank needs drops "
            f"from {fmt_bytes(peak)} to {fmt_bytes(spread.peak_after)}") in err
    assert "--set distributed.nproc=3 --set sharding.tables.t_cat_0.type=row_wise" in err
