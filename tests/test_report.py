"""``recpipe report RUN_DIR``: PNGs of a short CPU run, drawn from the TensorBoard scalars it wrote;
the run's resolved config is in TensorBoard as text."""

from __future__ import annotations

import json

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recpipe.cli import main
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.train.report import memory_peaks, memory_per_rank, read_scalars, write_report

SHORT = ["model.num_embeddings_per_feature=[500, 500, 200, 200]", "model.embedding_dim=8",
         "model.dense_arch_layer_sizes=[16, 8]", "model.over_arch_layer_sizes=[16, 1]", "sharding.tables={}",
         "data.batch_size=128", "data.synthetic.num_eval_batches=2", "distributed.nproc=1", "train.steps=20",
         "train.log_every=5", "train.eval_every=10", "train.progress=false"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 20-step run of the shipped quickstart config, named from a directory outside the checkout."""
    work = tmp_path_factory.mktemp("work")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        args = ["train", "--config", "quickstart", "--set", "logging.run_dir=run"]
        for pair in SHORT:
            args += ["--set", pair]
        assert main(args) == 0
    return work / "run"


def test_report_writes_a_png_per_recorded_figure(run_dir, tmp_path, capsys):
    capsys.readouterr()
    assert main(["report", str(run_dir), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    names = {"loss.png", "eval.png", "throughput.png", "memory.png"}  # CPU: memory is rank 0's peak RSS
    assert sorted(printed) == sorted(str(tmp_path / n) for n in names)
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name


def test_report_reads_what_the_run_logged(run_dir):
    scalars = read_scalars(run_dir)
    assert [s for s, _ in scalars["train/loss"]] == [5, 10, 15, 20]
    assert [s for s, _ in scalars["eval/auc"]] == [10, 20]
    assert all(0.0 < v < 1.0 for _, v in scalars["eval/auc"])


def test_the_resolved_config_is_in_tensorboard_as_text(run_dir):
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("config/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert yaml.safe_load("\n".join(line.removeprefix("    ") for line in shown.splitlines())) == \
        yaml.safe_load((run_dir / "config.yaml").read_text())
    assert text.step == 0


def test_report_of_a_directory_without_events_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "holds no TensorBoard events" in err and str(tmp_path) in err
    assert main(["report", str(tmp_path / "nope")]) == EXIT_BAD_CONFIG
    assert "is not a directory" in capsys.readouterr().err


def test_the_config_is_in_tensorboard_as_hparams_beside_the_eval_metrics(run_dir):
    from tensorboard.plugins.hparams import metadata

    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload()
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert {m.name.tag for m in experiment.metric_infos} == {f"eval/{n}" for n in ("auc", "ne", "logloss", "calibration",
                                                                                       "ctr", "accuracy")}
    started = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG]).hparams
    assert started["train.steps"].number_value == 20
    assert started["data.batch_size"].number_value == 128
    assert started["model.embedding_dim"].number_value == 8
    assert started["train.device"].string_value == "cpu"
    assert "model.num_embeddings_per_feature" not in started  # a list: the config text has it
    # the dashboard's metric values: the run's last eval scalars
    assert [s for s, _ in read_scalars(run_dir)["eval/auc"]] == [10, 20]


def test_each_evaluation_writes_a_histogram_of_each_tables_row_norms(run_dir):
    events = EventAccumulator(str(run_dir), size_guidance={"histograms": 0}).Reload()
    tags = sorted(events.Tags()["histograms"])
    assert tags == [f"embedding_row_norms/t_cat_{i}" for i in range(4)]
    rows = {"t_cat_0": 500, "t_cat_1": 500, "t_cat_2": 200, "t_cat_3": 200}
    for tag in tags:
        histograms = events.Histograms(tag)
        assert [h.step for h in histograms] == [10, 20]  # at each evaluation
        for h in histograms:
            assert h.histogram_value.num == rows[tag.split("/")[1]]  # every row: one rank holds them all
            assert 0 < h.histogram_value.min <= h.histogram_value.max


def test_row_norms_sample_at_most_max_rows_of_whole_rows():
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from recpipe.train.embedding_norms import local_row_norms

    tables = EmbeddingBagCollection([EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=1000,
                                                        feature_names=["f"])], device=torch.device("cpu"))
    weight = tables.state_dict()["embedding_bags.big.weight"]
    norms = local_row_norms(tables, max_rows=100)
    assert list(norms) == ["big"] and norms["big"].shape == (100,)
    assert torch.allclose(norms["big"][[0, -1]], weight[[0, -1]].norm(dim=1))  # evenly strided, both ends
    assert local_row_norms(tables)["big"].shape == (1000,)



def test_row_norms_of_a_table_over_2_to_the_24_rows_stay_inside_it():
    """MLPerf DLRM-DCNv2's 40M-row tables: a float32 linspace made the last sampled index
    40,000,000 (CUDA: a device-side assert at the first evaluation)."""
    import torch

    from recpipe.train.embedding_norms import strided_rows

    for count in (40_000_000, 2**24 + 1, 2**31 + 12345):
        index = strided_rows(count, 100_000)
        assert index.dtype == torch.int64 and index.numel() == 100_000
        assert index[0] == 0 and index[-1] == count - 1 and bool((index.diff() > 0).all())
    assert strided_rows(7, 100).tolist() == list(range(7)) and strided_rows(7, 1).tolist() == [0]
    assert strided_rows(1000, 100).tolist() == torch.linspace(0, 999, 100).long().tolist()  # small tables: the same rows

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A 4-step run on 2 Gloo ranks, one table row_wise and one column_wise."""
    run = tmp_path_factory.mktemp("two_ranks") / "run"
    split = ["model.num_embeddings_per_feature=[500, 500, 200, 200]", "model.embedding_dim=8",
             "model.dense_arch_layer_sizes=[16, 8]", "model.over_arch_layer_sizes=[16, 1]",
             "sharding.tables={t_cat_0: {type: row_wise}, t_cat_1: {type: column_wise}}", "data.batch_size=64",
             "data.synthetic.num_eval_batches=2", "distributed.nproc=2", "train.steps=4", "train.eval_every=4",
             "train.log_every=2", "train.progress=false", f"logging.run_dir={run}"]
    assert main(["train", "--config", "quickstart", *[a for pair in split for a in ("--set", pair)]]) == 0
    return run


def test_row_norms_over_two_ranks_are_rank_0s_whole_rows(two_ranks):
    """row_wise: rank 0's block of rows; column_wise (part of each row) left out; a table_wise
    table in the histograms only when it is placed on rank 0."""
    events = EventAccumulator(str(two_ranks), size_guidance={"histograms": 0}).Reload()
    rows = {tag.split("/")[1]: [h.histogram_value.num for h in events.Histograms(tag)]
            for tag in events.Tags()["histograms"]}
    assert rows.pop("t_cat_0") == [250]  # rank 0's half of 500 rows
    assert "t_cat_1" not in rows
    assert len(rows) == 1 and list(rows.values()) == [[200]]  # t_cat_2 or t_cat_3: the one rank 0 holds


def test_every_ranks_memory_is_logged_summarised_and_drawn(two_ranks, tmp_path):
    """Rank 0 logs each rank's memory at every log point (memory/rank<r>/..., CPU: peak RSS),
    keeps its own under the plain tags, puts each rank's peak in summary.json, and memory.png
    draws a line a rank."""
    scalars = read_scalars(two_ranks)
    for rank in (0, 1):
        points = scalars[f"memory/rank{rank}/peak_rss_gib"]
        assert [s for s, _ in points] == [2, 4]
        assert all(0.05 < v < 64 for _, v in points)  # a training process's RSS, in GiB
    assert scalars["memory/peak_rss_gib"] == scalars["memory/rank0/peak_rss_gib"]  # rank 0's, as before
    per_rank = memory_per_rank(scalars)
    assert list(per_rank) == ["peak_rss_gib"] and list(per_rank["peak_rss_gib"]) == [0, 1]
    (rank, peak), = memory_peaks(per_rank).values()
    assert peak == max(v for r in (0, 1) for _, v in per_rank["peak_rss_gib"][r])
    assert peak == max(v for _, v in per_rank["peak_rss_gib"][rank])

    summary = json.loads((two_ranks / "summary.json").read_text())
    assert [m["rank"] for m in summary["memory_per_rank"]] == [0, 1]
    for m in summary["memory_per_rank"]:
        assert set(m) == {"rank", "peak_rss_gib"}
        assert m["peak_rss_gib"] == pytest.approx(max(v for _, v in per_rank["peak_rss_gib"][m["rank"]]), abs=1e-3)

    assert tmp_path / "memory.png" in write_report(two_ranks, tmp_path)
    assert (tmp_path / "memory.png").read_bytes().startswith(PNG)


def test_memory_peaks_name_the_rank_with_the_highest_value():
    scalars = {"memory/rank0/max_allocated_gib": [(5, 1.0), (10, 2.0)],
               "memory/rank1/max_allocated_gib": [(5, 3.0), (10, 2.5)],
               "memory/rank0/max_reserved_gib": [(5, 4.0)], "memory/rank1/max_reserved_gib": [(5, 1.5)],
               "memory/max_allocated_gib": [(5, 1.0), (10, 2.0)], "train/loss": [(5, 0.5)]}
    per_rank = memory_per_rank(scalars)
    assert sorted(per_rank) == ["max_allocated_gib", "max_reserved_gib"]
    assert memory_peaks(per_rank) == {"max_allocated_gib": (1, 3.0), "max_reserved_gib": (0, 4.0)}
