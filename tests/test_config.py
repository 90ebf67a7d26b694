"""Every shipped config loads; every config mistake stops ``recpipe train`` with exit
code 2 and a message naming the key path and the value, before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.config import load_config

ROOT_CONFIGS = Path(__file__).parent.parent / "configs"
CONFIGS = sorted((Path(__file__).parent.parent / "configs").rglob("*.yaml"))
QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_config_loads_and_says_what_it_is(path: Path):
    load_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), f"{path} must open with a comment saying what it is for and how to run it"


def test_quickstart_and_gpu_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "dlrm_gpu.yaml", "dcnv2.yaml"} <= names


def _train(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.stepz=5"], ["train.stepz", "unknown key", "steps"]),
        (["train.steps=many"], ["train.steps", "'many'"]),
        (["sharding.default.cache_load_factor=0.2"], ["sharding.default.cache_load_factor=0.2", "fused_uvm_caching", "'fused'"]),
        # (a kernel left out under a table_wise default resolves to dense: test_table_entries_override_only_what_they_set)
        (["sharding.tables.t_cat_5={type: data_parallel, kernel: fused}"], ["sharding.tables.t_cat_5.kernel='fused'", "data_parallel", "'dense'"]),
        (["sharding.prefetch_passes=3"], ["sharding.prefetch_passes=3", "pipeline.name='prefetch'", "got 'sparse_dist'"]),
        (
            ["pipeline.name=prefetch", "sharding.prefetch_passes=2"],
            ["sharding.prefetch_passes=2", "fused_uvm_caching", "none is configured"],
        ),
        (["model.embeding_dim=8"], ["model.embeding_dim", "unknown key", "embedding_dim"]),
        (["train.steps.max=3"], ["--set train.steps.max", "'steps' is a value"]),
        (["train.steps"], ["--set 'train.steps'", "KEY=VALUE"]),
        (
            ["pipeline.name=warp_speed"],
            ["pipeline.name='warp_speed' is not a pipeline", "base, sparse_dist, fused_sparse_dist, semi_sync, prefetch"],
        ),
        (["pipeline={max_batches_ahead: 2}"], ["pipeline.name is missing", "base, sparse_dist"]),
        (["train.on_nonfinite=ignore"], ["train.on_nonfinite", "'ignore'", "'error'", "'skip_step'"]),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "cache-load-factor-without-cache",
        "data-parallel-fused",
        "multipass-without-prefetch",
        "prefetch-without-cached-table",
        "set-bad-key",
        "set-into-value",
        "set-without-value",
        "unknown-pipeline-name",
        "pipeline-without-name",
        "bad-on-nonfinite",
    ],
)
def test_config_mistake_exits_2_naming_key_and_value(capsys, overrides, expected):
    args = ["--config", QUICKSTART]
    for pair in overrides:
        args += ["--set", pair]
    code, err = _train(capsys, *args)
    assert code == EXIT_BAD_CONFIG, err
    for part in expected:
        assert part in err, f"{part!r} not in the message:\n{err}"


def test_user_errors_are_one_message_and_debug_adds_the_traceback(capsys):
    code, err = _train(capsys, "--config", QUICKSTART, "--set", "pipeline.name=warp_speed")
    assert code == EXIT_BAD_CONFIG and "Traceback" not in err and "tag" not in err
    assert err.rstrip().endswith(f"[exit {EXIT_BAD_CONFIG}]")
    code, err = _train(capsys, "--config", QUICKSTART, "--set", "pipeline.name=warp_speed", "--debug")
    assert code == EXIT_BAD_CONFIG and "Traceback" in err and "pipeline.name='warp_speed'" in err


def test_unknown_key_in_yaml_file_exits_2(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("# a config with a typo\ntrain:\n  steps: 5\n  eval_evry: 2\n")
    code, err = _train(capsys, "--config", str(path))
    assert code == EXIT_BAD_CONFIG
    assert "train.eval_evry: unknown key" in err and str(path) in err


def test_missing_config_file_exits_2(capsys, tmp_path):
    code, err = _train(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert code == EXIT_BAD_CONFIG
    assert "nope.yaml" in err and "does not exist" in err


def test_set_overrides_values_and_types():
    cfg = load_config(QUICKSTART, ["train.steps=50", "model.num_embeddings_per_feature=[10, 20, 30, 40]", "pipeline.name=sparse_dist"])
    assert cfg.train.steps == 50
    assert cfg.model.num_embeddings_per_feature == [10, 20, 30, 40]
    assert cfg.pipeline.name == "sparse_dist"
    assert load_config(QUICKSTART).train.steps != 50  # the file itself says otherwise


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optimizer.embedding.name=adam", "train.device=cpu"], "optimizer.embedding.name='adam'"),
        (["distributed.backend=nccl", "train.device=cpu"], "distributed.backend='nccl'"),
    ],
)
def test_machine_dependent_rules_exit_2_before_any_process(overrides, needle, capsys):
    from recpipe.cli import main

    args = ["train", "--config", str(ROOT_CONFIGS / "quickstart.yaml")]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_train_refuses_a_plan_that_does_not_fit_on_cuda(capsys):
    from recpipe.preflight import Machine, check_memory

    cfg = load_config(ROOT_CONFIGS / "quickstart.yaml", ["sharding.hbm_gb=0.5", "train.device=auto"])
    assert check_memory(cfg, Machine(cuda=True), world_size=2) == 3
    err = capsys.readouterr().err
    assert "does not fit" in err and "rank" in err
    # On CPU the GPU estimate is informational only.
    assert check_memory(cfg, Machine(cuda=False), world_size=2) is None
    assert capsys.readouterr().out == ""


def test_table_entries_override_only_what_they_set():
    # quickstart's four largest tables have entries ({type: row_wise}): a fp16 default
    # reaches them too (it used to be replaced by the entry, leaving them fp32).
    cfg = load_config(QUICKSTART, ["sharding.default={weights_precision: fp16, stochastic_rounding: false}"])
    for name in ("t_cat_0", "t_cat_9"):
        spec = cfg.sharding.for_table(name)
        assert (spec.weights_precision, spec.stochastic_rounding) == ("fp16", False), name
    assert cfg.sharding.for_table("t_cat_0").type == "row_wise"  # the entry's own field wins
    own = load_config(QUICKSTART, ["sharding.default={weights_precision: fp16}",
                                   "sharding.tables.t_cat_0.weights_precision=fp32"])
    assert own.sharding.for_table("t_cat_0").weights_precision == "fp32"
    assert own.sharding.for_table("t_cat_1").weights_precision == "fp16"
    # What does not apply to the entry's kernel or type is not inherited.
    cached = load_config(QUICKSTART, ["train.device=cuda", "sharding.default={kernel: fused_uvm_caching, cache_load_factor: 0.3, "
                                      "cache_precision: fp16}", "sharding.tables.t_cat_1={kernel: fused}",
                                      "sharding.tables.t_cat_2={type: column_wise}"])
    plain = cached.sharding.for_table("t_cat_1")
    assert (plain.kernel, plain.cache_load_factor, plain.cache_precision) == ("fused", None, None)
    col = cached.sharding.for_table("t_cat_2")
    assert (col.type, col.kernel, col.cache_load_factor, col.cache_precision) == (
        "column_wise", "fused_uvm_caching", 0.3, "fp16")
    ranked = load_config(QUICKSTART, ["sharding.default={rank: 1}", "sharding.tables.t_cat_5={kernel: fused}"])
    assert ranked.sharding.for_table("t_cat_5").rank == 1  # table_wise: the default's rank applies
    assert ranked.sharding.for_table("t_cat_0").rank is None  # row_wise: no rank
    # A data_parallel default (kernel dense, no TBE precision) and the tables sharded otherwise.
    dp = load_config(QUICKSTART, ["sharding.default={type: data_parallel, kernel: dense}",
                                  "sharding.tables.t_cat_5={type: table_wise, weights_precision: fp16}"])
    assert (dp.sharding.for_table("t_cat_0").type, dp.sharding.for_table("t_cat_0").kernel) == ("row_wise", "fused")
    assert dp.sharding.for_table("t_cat_5").kernel == "fused"
    assert dp.sharding.for_table("t_cat_9").kernel == "dense"
    half = load_config(QUICKSTART, ["sharding.default={weights_precision: fp16}", "sharding.tables.t_cat_6={type: data_parallel}"])
    assert (half.sharding.for_table("t_cat_6").kernel, half.sharding.for_table("t_cat_6").weights_precision) == ("dense", None)
    # The resolved config survives a dump and a reload unchanged (recpipe bench rebuilds configs so).
    from recpipe.config import config_from_dict
    for c in (cfg, own, cached, ranked, dp, half):
        assert config_from_dict(c.model_dump(mode="json")) == c
