"""``data.synthetic.device``: synthetic batches made by torch ops on a device (the rank's
GPU with ``cuda``), by producer threads that hand over host batches. On the CPU the
device path runs the same code with CPU tensors and a CPU generator, so most of it is
tested here; the CUDA stream and pinned copies are tested by the ``gpu`` tests."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from recpipe.cli import main
from recpipe.config import ConfigError, DataConfig, SyntheticConfig, load_config
from recpipe.data import make_dataloader
from recpipe.data.loader import _to_host, with_sized_workers, workers_description, workers_kind_of
from recpipe.data.spec import DataSpec
from recpipe.data.synthetic import SyntheticClickLog, _hash_unit, _hash_unit_torch
from recpipe.data.workers import GPU_PRODUCERS, size_gpu_workers
from recpipe.exit_codes import EXIT_BAD_CONFIG
from recpipe.preflight import Machine, check_machine

ROOT = Path(__file__).parent.parent
CPU = torch.device("cpu")
TABLES = (100_000, 5_000, 40, 1_000_000)


def _spec(hot: tuple[int, ...] | None = (3, 1, 2, 20), batch_size: int = 4096, pooling: float = 1.0) -> DataSpec:
    return DataSpec(batch_size=batch_size, seed=7, feature_names=tuple(f"f{i}" for i in range(len(TABLES))),
                    table_sizes=TABLES, num_dense=13, multi_hot_sizes=hot,
                    synthetic=SyntheticConfig(mean_pooling_factors=pooling))


def _cfg(**sets):
    return load_config(ROOT / "configs" / "quickstart.yaml", [f"{k}={v}" for k, v in sets.items()])


def test_the_torch_hash_is_numpys_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-2**63, 2**63 - 1, (200_000,), generator=g)
    keys = torch.randint(-2**63, 2**63 - 1, (200_000,), generator=g)
    ids[:4] = torch.tensor([0, 1, -1, 2**63 - 1])  # the edges of the int64 range
    expected = _hash_unit(ids.numpy().copy(), keys.numpy().copy())
    got = _hash_unit_torch(ids, keys)
    assert got.dtype == torch.float64 and np.array_equal(got.numpy(), expected)


def _head_share(values: torch.Tensor, top: int = 10) -> float:
    return sum(n for _, n in Counter(values.tolist()).most_common(top)) / values.numel()


@pytest.mark.parametrize("hot,pooling", [((3, 1, 2, 20), 1.0), (None, 1.0), (None, 2.5)],
                         ids=["multi_hot", "one_hot", "drawn_lengths"])
def test_the_device_path_on_the_cpu_has_the_host_paths_laws(hot, pooling):
    log = SyntheticClickLog(_spec(hot, pooling=pooling))
    host = [log.batch(rank=0, split="train", epoch=0, index=i) for i in range(4)]
    made = [log.batch(rank=0, split="train", epoch=0, index=i, device=CPU) for i in range(4)]
    rate = lambda batches: float(torch.cat([b.labels for b in batches]).mean())  # noqa: E731
    assert abs(rate(made) - 0.30) < 0.03 and abs(rate(made) - rate(host)) < 0.02
    for h, m in zip(host, made):
        kjt, ref = m.sparse_features, h.sparse_features
        assert m.dense_features.shape == h.dense_features.shape and m.dense_features.dtype == torch.float32
        assert kjt.keys() == ref.keys() and kjt.stride() == ref.stride()
        lengths = kjt.lengths().view(len(TABLES), -1)
        if hot is not None:
            assert (lengths == torch.tensor(hot, dtype=torch.int32).unsqueeze(1)).all()
        assert kjt.length_per_key() == lengths.sum(dim=1).tolist()
        for f, values in enumerate(kjt.values().split(kjt.length_per_key())):
            assert values.dtype == torch.int64 and 0 <= int(values.min()) and int(values.max()) < TABLES[f]
            if TABLES[f] > 1000:  # Zipf: a few hot ids take a large share, as the host path's
                assert abs(_head_share(values) - _head_share(ref.values().split(ref.length_per_key())[f])) < 0.05
        # On the CPU both paths draw the same numbers in the same order: the same batch but
        # for the last bits of a power or a sum.
        assert torch.equal(kjt.lengths(), ref.lengths()) and torch.equal(m.dense_features, h.dense_features)
        assert (kjt.values() == ref.values()).double().mean() > 0.9999
        torch.testing.assert_close(log.planted_logits(m.dense_features, kjt, device=CPU),
                                   log.planted_logits(h.dense_features, ref), rtol=0, atol=1e-9)


def test_a_device_batch_is_a_function_of_its_index():
    log = SyntheticClickLog(_spec())
    a, b = (log.batch(rank=1, split="train", epoch=2, index=5, device=CPU) for _ in range(2))
    other = log.batch(rank=1, split="train", epoch=2, index=6, device=CPU)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values()) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.sparse_features.values(), other.sparse_features.values())


def _on_the_cpu(monkeypatch):
    """The device path with CPU tensors in the real loader and producer threads."""
    monkeypatch.setattr("recpipe.data.loader.synthetic_device", lambda d: CPU)


def _device_cfg(**sets):
    return _cfg(**{"data.synthetic.device": "cuda", "train.device": "auto", "data.pin_memory": "false",
                   "data.synthetic.num_batches": 7, "data.multi_hot_sizes": [2] * 26, **sets})


def test_the_producer_threads_hand_over_the_same_batches_whatever_their_number(monkeypatch):
    _on_the_cpu(monkeypatch)
    runs = {}
    for workers in (0, 1, 3):
        cfg = _device_cfg(**{"data.num_workers": workers})
        assert workers == 0 or workers_kind_of(cfg) == "thread"
        runs[workers] = list(make_dataloader(cfg, rank=0, world_size=1, split="train", start_batch=2))
    assert [len(r) for r in runs.values()] == [5, 5, 5]
    log = SyntheticClickLog(DataSpec.from_config(_device_cfg()))
    for i, batches in enumerate(zip(*runs.values())):
        expected = log.batch(rank=0, split="train", epoch=0, index=2 + i, device=CPU)
        for b in batches:
            assert torch.equal(b.sparse_features.values(), expected.sparse_features.values())
            assert torch.equal(b.dense_features, expected.dense_features) and torch.equal(b.labels, expected.labels)


def test_a_device_batch_is_handed_over_in_new_host_tensors():
    made = SyntheticClickLog(_spec()).batch(rank=0, split="train", epoch=0, index=0, device=CPU)
    host = _to_host(made, pin=False)
    pairs = [(made.dense_features, host.dense_features), (made.labels, host.labels), (made.weights, host.weights),
             (made.sparse_features.values(), host.sparse_features.values()),
             (made.sparse_features.lengths(), host.sparse_features.lengths())]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in pairs)
    kjt = host.sparse_features
    assert kjt.keys() == made.sparse_features.keys() and kjt.length_per_key() == made.sparse_features.length_per_key()


def test_auto_starts_a_few_threads_on_the_gpu_and_says_why(monkeypatch):
    _on_the_cpu(monkeypatch)
    cfg = _device_cfg(**{"data.num_workers": "auto"})
    sized, sizing = with_sized_workers(cfg, rank=0, world_size=1)
    low, high = GPU_PRODUCERS
    assert sizing is not None and sizing.batch_seconds is not None
    assert low <= sized.data.num_workers == sizing.workers <= high
    line = sizing.line(workers_description(sized))
    assert "producer threads on the GPU" in line and "threads on the GPU: each waits for its own stream" in line
    assert size_gpu_workers(cores=64, batch_seconds=0.0001, batch_size=8192).workers == low
    assert size_gpu_workers(cores=1, batch_seconds=0.05, batch_size=8192).workers == high
    assert size_gpu_workers(cores=8, batch_seconds=0.0025, batch_size=8192).workers == 3  # 2.4 needed


def test_a_process_workers_kind_is_replaced_by_threads_with_a_warning(monkeypatch):
    cfg = _device_cfg(**{"data.num_workers": 2, "data.workers_kind": "process"})
    with pytest.warns(UserWarning, match="data.workers_kind='process' is ignored: data.synthetic.device='cuda'"):
        assert workers_kind_of(cfg) == "thread"


@pytest.mark.parametrize("sets,message", [
    ({"data.source": "binary", "data.binary.train_dir": "/nowhere"},
     "data.synthetic.device='cuda' makes synthetic batches on the GPU, but data.source='binary'"),
    ({"train.device": "cpu"}, "data.synthetic.device='cuda' makes the batches on the rank's GPU, but train.device='cpu'"),
])
def test_the_config_refuses_the_gpu_path_where_it_cannot_run(sets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        _cfg(**{"data.synthetic.device": "cuda", **sets})


def test_a_data_factory_refuses_the_gpu_path():
    with pytest.raises(ValueError, match="data.synthetic.device='cuda' makes synthetic batches on the GPU, but "
                                         "data.factory='slow_data:slow_train' makes this run's batches"):
        DataConfig(factory="slow_data:slow_train", synthetic={"device": "cuda"})
    assert DataConfig(factory="slow_data:slow_train").synthetic.device == "cpu"


def test_a_machine_or_rank_without_cuda_is_refused(monkeypatch):
    cfg = _device_cfg()
    with pytest.raises(ConfigError, match="data.synthetic.device='cuda' but this machine has no CUDA GPU"):
        check_machine(cfg, Machine(cuda=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"data.synthetic.device='cuda' but this process has no CUDA GPU"):
        make_dataloader(cfg, rank=0, world_size=1, split="train")
    code = main(["data", "bench", "--config", str(ROOT / "configs" / "quickstart.yaml"),
                 "--set", "data.synthetic.device=cuda", "--set", "train.device=auto", "--set", "data.num_workers=0"])
    assert code == EXIT_BAD_CONFIG


def test_the_host_path_is_unchanged_by_default():
    assert SyntheticConfig().device == "cpu" and workers_kind_of(_cfg(**{"train.device": "cpu"})) == "process"
    log = SyntheticClickLog(_spec())
    assert torch.equal(log.batch(rank=0, split="eval", epoch=0, index=1).labels,
                       log.batch(rank=0, split="eval", epoch=3, index=1, device=None).labels)


# ------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_cuda_producers_hand_over_pinned_batches_the_same_whatever_their_number():
    runs = {}
    for workers in (1, 3):
        cfg = _cfg(**{"data.synthetic.device": "cuda", "train.device": "cuda", "data.num_workers": workers,
                      "data.synthetic.num_batches": 6, "data.multi_hot_sizes": [3] * 26})
        runs[workers] = list(make_dataloader(cfg, rank=0, world_size=1, split="train"))
    for one, three in zip(*runs.values()):
        for a, b in ((one.dense_features, three.dense_features), (one.labels, three.labels),
                     (one.sparse_features.values(), three.sparse_features.values()),
                     (one.sparse_features.lengths(), three.sparse_features.lengths())):
            assert a.device.type == "cpu" and a.is_pinned() and b.is_pinned() and torch.equal(a, b)
    labels = torch.cat([b.labels for b in runs[1]])
    assert abs(float(labels.mean()) - 0.30) < 0.05


@pytest.mark.gpu
def test_mlperf_shapes_train_with_batches_made_on_the_gpu(tmp_path):
    """tests/test_configs_train_gpu.py's mlperf_dcnv2 run (0.859 there with host batches), its
    batches made on the GPU: the same laws, so it trains as well."""
    from config_training import assert_trains, reduced, train

    name = "bench/mlperf_dcnv2.yaml"
    overrides = reduced(name, max_rows=1_000_000, batch_size=None, steps=300, log_every=10, eval_batches=8,
                        device="cuda") + ["data.synthetic.device=cuda"]
    assert_trains(train(name, overrides, tmp_path / "run"), 0.80)
