"""fp16 tables and bf16 comms on CUDA streams (NCCL), 1, 2 and 4 GPUs (bf16 comms), 1 and 2 (resume): every pipeline
trains exactly like the plain loop (semi_sync like its reference), so the
cross-stream hand-offs stay correct when torchrec's quantized all-to-alls encode
and decode the pooled embeddings; and a checkpoint of fp16 tables resumes exactly.

    python -m pytest -m gpu -q tests/test_sharding_precision_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline_harness import assert_same, make_batches, semi_sync_reference, small_config, train
from recpipe.distributed import init_process_group
from recpipe.launcher import launch_local
import schedule_variants as variants

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PRECISE = ["train.device=cuda", "sharding.default={weights_precision: fp16}",
           "sharding.tables={t_cat_1: {type: row_wise, weights_precision: fp16}, "
           "t_cat_2: {type: column_wise, weights_precision: fp16}}",
           "sharding.comm_precision={forward: bf16, backward: bf16}"]


def _numerics(cfg) -> None:
    device = init_process_group(cfg)
    batches = make_batches(cfg, 8, dist.get_rank())
    reference = train(cfg, "base", batches, device=device)
    assert all(v.dtype == torch.float16 for k, v in reference.state.items() if "embedding_bags" in k)
    for name, options in [("sparse_dist", {}), ("fused_sparse_dist", {}),
                          ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_OWN_STREAM}),
                          ("fused_sparse_dist", {"schedule": variants.FUSED_LOOKUP_ON_DIST}), ("prefetch", {})]:
        assert_same(reference, train(cfg, name, batches, device=device, **options), f"cuda fp16/bf16 {name} {options}")
    for start_batch, stash in [(0, False), (2, True)]:
        got = train(cfg, "semi_sync", batches, device=device, start_batch=start_batch, stash_gradients=stash)
        assert_same(semi_sync_reference(cfg, batches, start_batch, stash, device=device), got,
                    f"cuda fp16/bf16 semi_sync {start_batch} {stash}")


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_pipelines_match_base_with_fp16_tables_and_bf16_comms(nproc):
    launch_local(_numerics, nproc, small_config(nproc, PRECISE))


@pytest.mark.parametrize("nproc", [1, 2])
def test_fp16_tables_resume_bit_identically_on_cuda(nproc, tmp_path):
    """Stochastic rounding draws from the CUDA generator, which the checkpoint saves:
    a resumed run equals the uninterrupted one bit for bit."""
    from pathlib import Path

    from recpipe.cli import main
    from test_checkpoint import TINY, K, M, _full_state

    config = Path(__file__).parent.parent / "configs" / "quickstart.yaml"

    def run(out: Path, steps: int, every: int) -> int:
        args = ["train", "--config", str(config)]
        for pair in TINY + [f"train.steps={steps}", f"checkpoint.dir={out / 'ckpt'}", f"checkpoint.every={every}",
                            "checkpoint.keep=1", f"logging.run_dir={out}", f"distributed.nproc={nproc}",
                            "train.device=cuda", "distributed.backend=auto", *PRECISE[1:]]:
            args += ["--set", pair]
        return main(args)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(straight, K + M, 0) == 0
    assert run(resumed, K, K) == 0
    assert run(resumed, K + M, K) == 0
    a = _full_state(straight / "ckpt" / f"step_{K + M:08d}", tmp_path)
    b = _full_state(resumed / "ckpt" / f"step_{K + M:08d}", tmp_path)
    assert {v.dtype for k, v in a.items() if k.startswith("model.") and "embedding_bags" in k} == {torch.float16}
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"


@pytest.mark.gpus(2)
def test_tbes_write_bf16_and_train_as_torchrecs_codecs_on_cuda():
    """bf16 both ways on two GPUs: the TBEs write bf16 pooled outputs, cast codecs only
    (tests/test_sharding_precision.py, the CPU version with fp16)."""
    from test_sharding_precision import _tbe_output_worker

    launch_local(_tbe_output_worker, 2, small_config(2, PRECISE))
