"""Every shipped config trains (CPU): each file under configs/ trains on its own data with
every log interval's mean loss finite and below ``config_training.LOSS_BOUND`` (0.75, ln 2
+ 0.057: the module says why), the loss falling and the final eval AUC at the value each
case states. The CPU configs run as shipped, shortened; the CUDA configs run on CPU with
their tables capped, small batches and their optimizer settings, ids' law and (where
affordable) widths. tests/test_configs_train_gpu.py trains the CUDA ones on a GPU with
their batch sizes and architectures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from config_training import CONFIGS, assert_trains, reduced, train
from recpipe.cli import main


@dataclass(frozen=True)
class Case:
    config: str
    min_auc: float  # what the shortened run reaches, less a margin (the measured value: in the comment)
    steps: int
    log_every: int = 10
    batch_size: int | None = None  # None: the config's
    max_rows: int = 2000
    extra: tuple[str, ...] = ()


# The CUDA configs' CPU runs keep what CPU can run. On CPU: fp32 for the dense part where the
# config says bf16 (CPU autocast's bf16 matmuls are about 12 x slower than fp32 here), tables
# without UVM and the pipeline of tables in memory, narrower layers where the widths cost
# seconds a step. The GPU test keeps all of it.
NARROW_DCN = ("model.over_arch_layer_sizes=[256, 128, 64, 1]", "model.dcn_low_rank_dim=64", "train.precision=fp32")
NO_UVM = ("sharding.uvm_host_mapped=false", "pipeline.name=sparse_dist",
          "sharding.tables={t_cat_0: {type: row_wise}, t_cat_1: {type: row_wise}, t_cat_2: {type: row_wise}, "
          "t_cat_3: {type: row_wise}}")

CASES = [
    Case("quickstart.yaml", 0.78, steps=60),  # 0.810
    Case("dcnv2.yaml", 0.82, steps=60),  # 0.848
    Case("two_tower.yaml", 0.55, steps=200, log_every=20),  # 0.574
    Case("bench/smoke_cpu.yaml", 0.73, steps=100),  # 0.767
    Case("dlrm_gpu.yaml", 0.75, steps=100, batch_size=64),  # 0.790
    Case("bench/dlrm_criteo.yaml", 0.72, steps=100, batch_size=64),  # 0.756
    Case("bench/dlrm_criteo_gpu_bound.yaml", 0.73, steps=100, batch_size=128),  # 0.768
    Case("bench/uvm_caching.yaml", 0.72, steps=100, batch_size=64, extra=NO_UVM),  # 0.756
    Case("bench/mlperf_dcnv2.yaml", 0.74, steps=100, batch_size=64, extra=NARROW_DCN),  # 0.753
    # Its full width: Adam's first step overshoots on the 4096-wide layers, not on narrower ones.
    Case("bench/optimizer_heavy.yaml", 0.57, steps=20, batch_size=32),  # 0.599
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.config)
def test_config_trains(tmp_path, case):
    overrides = reduced(case.config, max_rows=case.max_rows, batch_size=case.batch_size, steps=case.steps,
                        log_every=case.log_every, eval_batches=8, device="cpu")
    assert_trains(train(case.config, overrides + list(case.extra), tmp_path / "run"), case.min_auc)


@pytest.mark.slow
def test_binary_quickstart_trains_on_converted_data(tmp_path):
    # Its own data: TSV lines of the synthetic click log, converted as docs/data.md says.
    from scripts.synthetic_tsv import write_file
    from recpipe.config import load_config

    name = "binary_quickstart.yaml"
    cfg = load_config(CONFIGS / name)
    steps, ranks, batch = 60, cfg.distributed.nproc, cfg.data.batch_size
    tsv = tmp_path / "tsv"
    tsv.mkdir()
    for rank in range(2):
        write_file(cfg, tsv / f"day_{rank}.tsv", steps * ranks * batch // 2, rank, "train")
    write_file(cfg, tsv / "eval.tsv", 4096, 0, "eval")
    data = tmp_path / "data"
    for split, files in (("train", ["day_0.tsv", "day_1.tsv"]), ("eval", ["eval.tsv"])):
        assert main(["data", "convert", "--config", str(CONFIGS / name), "--out", str(data / split), "--no-progress",
                     *(str(tsv / f) for f in files)]) == 0
    overrides = reduced(name, max_rows=10**9, batch_size=None, steps=steps, log_every=10, eval_batches=8, device="cpu")
    overrides += [f"data.binary.train_dir={data / 'train'}", f"data.binary.eval_dir={data / 'eval'}", "train.epochs=1"]
    assert_trains(train(name, overrides, tmp_path / "run"), 0.77)  # 0.798


def test_every_shipped_config_is_trained_here():
    shipped = {str(p.relative_to(CONFIGS)) for p in Path(CONFIGS).rglob("*.yaml")}
    assert shipped == {c.config for c in CASES} | {"binary_quickstart.yaml"}
