"""Every shipped config loads; every config mistake stops ``recpipe train`` with exit
code 2 and a message naming the key path and the value, before any process starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.config import ConfigError, load_config

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


def test_unknown_key_in_yaml_names_the_closest_allowed_key(capsys, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("# a config with a typo\ntrain:\n  stpes: 5\n")
    code, err = _train(capsys, "--config", str(path))
    assert code == EXIT_BAD_CONFIG
    assert "train.stpes: unknown key; did you mean 'steps'? allowed here: " in err, err


@pytest.mark.parametrize(
    "pair, hint",
    [
        ("model.embeding_dim=8", "model.embeding_dim: unknown key; did you mean 'embedding_dim'?"),
        ("train.evl_every=3", "train.evl_every: unknown key; did you mean 'eval_every' or 'log_every'?"),
        ("train.zzzzz=1", "train.zzzzz: unknown key; allowed here: "),  # nothing close: no guess
    ],
)
def test_unknown_key_in_set_names_the_closest_allowed_keys(capsys, pair, hint):
    code, err = _train(capsys, "--config", QUICKSTART, "--set", pair)
    assert code == EXIT_BAD_CONFIG
    assert hint in err, err
    assert len(err.strip().splitlines()) == 1, err


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

    cfg = load_config(ROOT_CONFIGS / "quickstart.yaml", ["sharding.hbm_gib=0.5", "train.device=auto"])
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


# ------------------------------------------------------------- the config file itself: bounded input, exit 2
def _one_line(err: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1 and err.endswith(f"[exit {EXIT_BAD_CONFIG}]\n"), err
    return err


def _plan(capsys, path, *overrides: str) -> str:
    """``recpipe plan`` on ``path``: it must refuse with exit 2 and one line, which is returned."""
    args = ["plan", "--config", str(path)]
    for pair in overrides:
        args += ["--set", pair]
    assert main(args) == EXIT_BAD_CONFIG
    return _one_line(capsys.readouterr().err)


BOMB = """# nine levels of ten aliases each: 10^9 strings once expanded
model:
  options:
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_yaml_aliases_are_refused_naming_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(ConfigError):
        load_config(path)
    line = _plan(capsys, path)
    assert f"config file {str(path)!r}, line 5, column 12: a YAML alias (*a) is not allowed in a config" in line, line
    # The same in a --set value.
    line = _plan(capsys, QUICKSTART, "model.options={a: &a [1, 2], b: *a}")
    assert "--set model.options={a: &a [1, 2], b: *a}: not a YAML value (line 1, column 19: a YAML alias (*a)" in line


def test_a_config_file_larger_than_the_limit_is_refused_before_it_is_parsed(tmp_path, capsys):
    from recpipe.config import MAX_CONFIG_BYTES

    path = tmp_path / "big.yaml"
    head = "# a config with a long comment\ntrain:\n  steps: 5\n# "
    path.write_text(head + "x" * (MAX_CONFIG_BYTES - len(head) - 1) + "\n")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(path).train.steps == 5  # at the limit: read
    with path.open("a") as fh:
        fh.write("#")
    line = _plan(capsys, path)
    assert f"config file {str(path)!r} is larger than 1 MiB, the most a config may be" in line, line


def test_yaml_nested_deeper_than_any_config_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("# brackets\nmodel:\n  options:\n    x: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested more than 64 levels deep" in _plan(capsys, path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_config_paths_that_are_not_regular_files_say_what_they_are(tmp_path, capsys):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # opening it would wait for a writer
    for path, what in [(tmp_path, "a directory"), (fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a character device")]:
        if not path.exists():
            continue
        line = _plan(capsys, path)
        assert f"config file {str(path)!r} is {what}, not a regular file" in line, line


def test_duplicate_keys_are_refused_naming_both_lines_and_the_key_path(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("# train: twice\ntrain:\n  device: cpu\n  log_every: 5\nmodel:\n  embedding_dim: 16\n"
                    "train:\n  steps: 3\n")
    line = _plan(capsys, path)
    assert f"config file {str(path)!r}, line 7, column 1: train is given twice (first on line 2)" in line, line
    path.write_text("# a key twice\nsharding:\n  tables:\n    t_cat_0: {type: row_wise, type: table_wise}\n")
    line = _plan(capsys, path)
    assert "line 4, column 31: sharding.tables.t_cat_0.type is given twice (first on line 4)" in line, line
    line = _plan(capsys, QUICKSTART, "train={steps: 1, steps: 2}")
    assert "train.steps is given twice" in line, line


@pytest.mark.parametrize("yaml_text, key", [
    ('train:\n  steps: "100"\n', "train.steps"),
    ("optimizer:\n  dense: {lr: '0.1'}\n", "optimizer.dense.lr"),
    ("model:\n  num_embeddings_per_feature: ['10', 20]\n", "model.num_embeddings_per_feature.0"),
    ("train:\n  log_every: 5.0\n", "train.log_every"),
])
def test_strings_are_not_numbers(tmp_path, capsys, yaml_text, key):
    path = tmp_path / "quoted.yaml"
    path.write_text("# quoted numbers\n" + yaml_text)
    line = _plan(capsys, path)
    assert f"{key}: Input should be a valid" in line, line


def test_numbers_from_yaml_and_from_set_keep_their_type():
    cfg = load_config(QUICKSTART, ["train.steps=100", "optimizer.dense.lr=1", "train.step_timeout_s=30"])
    assert (cfg.train.steps, cfg.optimizer.dense.lr, cfg.train.step_timeout_s) == (100, 1.0, 30.0)
    with pytest.raises(ConfigError, match="train.steps: Input should be a valid integer"):
        load_config(QUICKSTART, ['train.steps="100"'])


@pytest.mark.parametrize("value, ok", [("0.001", False), ("0.5", False), ("0", True), ("null", True), ("1", True)])
def test_step_timeout_has_a_lower_bound(capsys, value, ok):
    if ok:
        load_config(QUICKSTART, [f"train.step_timeout_s={value}"])
        return
    line = _plan(capsys, QUICKSTART, f"train.step_timeout_s={value}")
    assert f"train.step_timeout_s: must be 0 (off) or at least 1 s" in line and f"(got {value})" in line, line


def test_numbers_in_exponent_form_are_floats_in_files_and_overrides(tmp_path):
    """``1e12`` and ``1e-3`` (YAML 1.2 floats; YAML 1.1, PyYAML's, reads them as strings) are floats,
    in a file and in --set; a quoted one stays a string, which no number field takes."""
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  dense: {name: adagrad, lr: 1e-3}\n")
    cfg = load_config(str(path), ["optimizer.embedding.lr=1e12", "train.steps=100"])
    assert cfg.optimizer.dense.lr == 0.001 and cfg.optimizer.embedding.lr == 1e12 and cfg.train.steps == 100
    with pytest.raises(ConfigError, match="optimizer.dense.lr"):
        load_config(None, ['optimizer.dense.lr="1e-3"'])
