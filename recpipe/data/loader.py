"""Loaders of whole :class:`Batch` objects: synthetic log, Criteo TSV, binary or
Criteo ``.npy`` days.

Contract of :func:`make_dataloader`: iterating yields ``Batch`` objects in
batch-index order ``start_batch, start_batch + 1, ...`` of ``rank``'s ``split``
stream, bit-for-bit identical whatever ``data.num_workers`` is.

* synthetic, binary, criteo_npy: a :class:`~recpipe.data.stream.BatchStream`, whose
  ``data.num_workers`` producers make the batches: forked processes that hand them
  over through shared-memory slots (``data.workers_kind: process``, the default),
  or threads of the training process (``thread``); ``num_workers: 0`` makes them in
  the training loop itself. On CUDA with ``data.pin_memory`` they arrive in pinned
  memory. See ``stream`` for why processes.
* criteo_tsv: a torch DataLoader with ``data.num_workers`` *forked* worker
  processes (parsing is pure Python, so threads would share one core). Worker ``w``
  of ``n`` makes batch indices ``start_batch + w, start_batch + w + n, ...`` and the
  DataLoader takes one result from each worker in turn, which restores the order.
  Forked, not spawned: a spawned worker would import torch, torchrec and fbgemm
  again (seconds, and fbgemm's import warnings) before its first batch; the
  workers never touch CUDA. Like the producers, they ignore SIGTERM, SIGINT and
  SIGHUP and die with their rank (``init_worker``). Everything handed to workers
  is module-level, so the loader also works where only spawn exists.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.callables import load_callable
from recpipe.config import ConfigError, DataConfig, RecpipeConfig
from recpipe.errors import DataError, job_warning
from recpipe.data.batch import Batch
from recpipe.data.binary import BinaryDataset
from recpipe.data.binary_format import BinaryDataError, Layout, Manifest, read_manifest, unverified
from recpipe.data.criteo import CriteoTsvReader, open_lines
from recpipe.data.criteo_npy import CriteoNpyDataset, open_days, sparse_suffix
from recpipe.data.spec import DataSpec
from recpipe.data.stream import BatchStream, workers_kind
from recpipe.data.synthetic import SyntheticClickLog, num_synthetic_batches
from recpipe.data.workers import WorkersSizing, rank_cores, size_gpu_workers, size_workers
from recpipe.system import die_with_parent, local_world_size
from recpipe.stop_requests import ignore_stop_signals, stop_signals_blocked

__all__ = ["check_data", "epoch_batches", "host_memory_tables", "make_dataloader", "no_eval_data", "num_batches", "with_sized_workers",
           "workers_description", "workers_kind_of"]


def _check(rank: int, world_size: int, split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size={world_size})")


def _tsv_files(d: DataConfig, split: str) -> list[str]:
    crit = d.criteo
    return list(crit.train_files if split == "train" else crit.eval_files)


def _binary_dir(d: DataConfig, split: str) -> str | None:
    b = d.binary
    return b.train_dir if split == "train" else b.eval_dir


def _npy_days(d: DataConfig, split: str) -> list[str]:
    return list(d.npy.train if split == "train" else d.npy.eval)


def num_batches(cfg: RecpipeConfig, *, rank: int, world_size: int, split: str) -> int | None:
    """Batches ``rank`` has in ``split`` per epoch; None when only reading would tell (TSV).

    A TSV or binary split without data has 0 batches; all TSV and binary ranks have
    equal counts."""
    _check(rank, world_size, split)
    d = cfg.data
    if d.factory is not None:
        return None
    if d.source == "synthetic":
        return num_synthetic_batches(d.synthetic, rank=rank, split=split)
    if d.source == "binary":
        directory = _binary_dir(d, split)
        if directory is None:
            return 0
        rows = read_manifest(directory).num_rows
        return -(-rows // (world_size * d.batch_size))
    if d.source == "criteo_npy":
        rows = sum(part.rows for part in _open_npy_days(d, DataSpec.from_config(cfg), split))  # headers only
        return -(-rows // (world_size * d.batch_size))
    return None if _tsv_files(d, split) else 0


def no_eval_data(d: DataConfig) -> str:
    """Why the configured source (``d``: the ``data`` section) has no eval batches, naming
    its config key (for the message that evaluation is skipped; call it when
    ``num_batches`` of "eval" is 0)."""
    if d.source == "binary":
        eval_dir = d.binary.eval_dir
        return "data.binary.eval_dir is not set" if eval_dir is None else f"data.binary.eval_dir={eval_dir!r} holds no rows"
    if d.source == "criteo_tsv":
        return "data.criteo.eval_files is empty"
    if d.source == "criteo_npy":
        return "data.npy.eval is empty" if not d.npy.eval else f"data.npy.eval={d.npy.eval} holds no rows"
    return f"data.synthetic.num_eval_batches={d.synthetic.num_eval_batches}"


def check_data(cfg: RecpipeConfig) -> None:
    """Before any process starts: the TSV files exist and the training files hold a
    line; a binary dataset is complete, of the config's layout, every file has its
    manifest header and size, the training split has rows, and the train and eval
    datasets hash ids alike; every ``.npy`` day has its three files, of the config's
    layout, and the training days have rows. Raises ``DataError`` /
    ``BinaryDataError`` naming the file or directory (exit 5; ``ConfigError`` for
    missing TSV files). A ``data.factory`` is only known by what it yields: the
    trainer stops with a ``DataError`` when an epoch of it has no batch on any rank."""
    d, spec = cfg.data, DataSpec.from_config(cfg)
    if d.factory is not None:
        return
    if d.source == "criteo_tsv":
        crit = d.criteo
        for key, files in (("train_files", crit.train_files), ("eval_files", crit.eval_files)):
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise ConfigError(f"data.criteo.{key}: no such file(s) {missing}")
        # Empty files among others add nothing; all of them empty is no training data.
        if not any(_has_a_line(f) for f in crit.train_files):
            shown = ", ".join(crit.train_files)
            raise DataError(f"data.criteo.train_files: {shown} hold{'s' if len(crit.train_files) == 1 else ''} no line: "
                            "no training data")
    if d.source == "binary":
        hashing = {}
        for split in ("train", "eval"):
            if _binary_dir(d, split) is not None:
                dataset = _binary_dataset(d, spec, rank=0, world_size=1, split=split)
                if split == "train" and dataset.num_rows == 0:
                    raise BinaryDataError(f"data.binary.train_dir={_binary_dir(d, split)!r} holds no rows: no "
                                          "training data")
                manifest = read_manifest(_binary_dir(d, split))
                hashing[split] = manifest.hashing
                _hint_unverified(manifest, f"data.binary.{split}_dir")
        if len(set(hashing.values())) > 1:
            raise BinaryDataError(f"data.binary.train_dir holds ids hashed by {hashing['train']}'s rule, "
                                  f"data.binary.eval_dir by {hashing['eval']}'s: convert both with the same "
                                  "`recpipe data convert --hashing`")
    if d.source == "criteo_npy":
        for split in ("train", "eval"):
            days = _open_npy_days(d, spec, split)
            if split == "train" and not sum(day.rows for day in days):
                raise BinaryDataError(f"data.npy.train={d.npy.train} holds no rows: no training data")


def _hint_unverified(manifest: Manifest, key: str) -> None:
    """Say (once for the job) when a binary dataset's SHA-256s were never checked, or a
    file was written since: opening it checks sizes and every batch's ranges, so a value
    changed within its range trains silently; ``recpipe data verify`` catches it."""
    why = unverified(manifest)
    if why is not None:
        d = str(manifest.directory)
        job_warning(f"{key}={d!r}: {why}; `recpipe data verify {d}` checks every file against the SHA-256 in its "
                    "manifest (a changed value within its range trains silently otherwise)", stacklevel=3)


def _open_npy_days(d: DataConfig, spec: DataSpec, split: str) -> list:
    return open_days(_npy_days(d, split), num_dense=spec.num_dense, hotness=spec.hotness,
                     suffix=sparse_suffix(d.npy.sparse_suffix, d.multi_hot_sizes is not None), key=f"data.npy.{split}")


def _npy_dataset(d: DataConfig, spec: DataSpec, *, rank: int, world_size: int, split: str) -> CriteoNpyDataset:
    return CriteoNpyDataset(
        _npy_days(d, split),
        key=f"data.npy.{split}",
        keys=list(spec.feature_names),
        table_sizes=list(spec.table_sizes),
        num_dense=spec.num_dense,
        hotness=spec.hotness,
        sparse_suffix=sparse_suffix(d.npy.sparse_suffix, d.multi_hot_sizes is not None),
        ids=d.npy.ids,
        batch_size=d.batch_size,
        rank=rank,
        world_size=world_size,
        shuffle=d.shuffle and split == "train",
        block_rows=d.shuffle_block_rows,
        seed=spec.seed,
    )


def _has_a_line(path: str) -> bool:
    with open_lines(path) as lines:
        try:
            return bool(lines.readline())
        except ValueError as err:  # damaged gzip data at the start
            raise DataError(f"data.criteo: {err}") from None


def _binary_dataset(d: DataConfig, spec: DataSpec, *, rank: int, world_size: int, split: str) -> BinaryDataset:
    directory = _binary_dir(d, split)
    assert directory is not None
    if not Path(directory).is_dir():
        raise BinaryDataError(f"data.binary.{split}_dir={directory!r} is not a directory")
    return BinaryDataset(
        directory,
        Layout.from_spec(spec),
        list(spec.feature_names),
        batch_size=spec.batch_size,
        rank=rank,
        world_size=world_size,
        shuffle=d.shuffle and split == "train",
        block_rows=d.shuffle_block_rows,
        seed=spec.seed,
    )


def _worker_slice(start: int, stop: int | None) -> Iterator[int]:
    """This worker's batch indices out of ``start .. stop-1`` (open-ended if stop is None)."""
    info = get_worker_info()
    worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
    return itertools.islice(itertools.count(start), worker, None if stop is None else max(stop - start, 0), workers)


class CriteoTsvDataset(IterableDataset):
    """Batches ``start_batch ..`` of one rank's part of the TSV files (see ``criteo``).

    Each worker scans the files itself and parses only its own batches' lines
    (skipping is cheap next to parsing).
    """

    def __init__(self, reader: CriteoTsvReader, *, start_batch: int) -> None:
        self.reader = reader
        self.start = start_batch

    def __iter__(self) -> Iterator[Batch]:
        return self.reader.batches(_worker_slice(self.start, None))


def user_batches(cfg: RecpipeConfig, *, rank: int, world_size: int, split: str, epoch: int, start_batch: int) -> Iterable[Any]:
    """``data.factory(cfg, rank=, world_size=, split=, epoch=, start_batch=)``: the
    user's batches (None = no batches for this split, e.g. no eval data)."""
    fn = load_callable(cfg.data.factory, "data.factory")
    try:
        batches = fn(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch)
    except Exception as err:  # the user's code: name the key, keep the cause
        raise ConfigError(f"data.factory={cfg.data.factory!r} raised {type(err).__name__}: {err}") from err
    if batches is None:
        return []
    if not hasattr(batches, "__iter__"):
        raise ConfigError(
            f"data.factory={cfg.data.factory!r} returned {type(batches).__name__} for split={split!r}; it must "
            "return an iterable of batches (or None when the split has no data)"
        )
    return batches


def identity_collate(batch: Batch) -> Batch:
    """The dataset yields finished batches; module-level so spawn can pickle it."""
    return batch


def init_worker(worker_id: int, parent_pid: int) -> None:
    """A TSV DataLoader worker, first thing (``worker_init_fn``, with ``parent_pid`` the
    rank's pid): it dies with its rank, however the rank ends (a rank killed with SIGKILL
    left its workers running for seconds, whose exit then failed on files the launcher had
    removed); it ignores the stop signals, which its rank acts on at a step boundary
    (torch's workers end on a SIGTERM to the process group, which failed the run); and it
    makes whole batches alone: intra-op threads would only oversubscribe."""
    die_with_parent(parent_pid)
    ignore_stop_signals()
    torch.set_num_threads(1)


class TsvDataLoader(DataLoader):
    """torch's DataLoader whose worker processes start with the stop signals blocked, until
    ``init_worker`` ignores them: a signal to the process group while they start is not
    theirs to act on."""

    def __iter__(self) -> Iterator[Any]:
        with stop_signals_blocked():  # the workers start in iter() (persistent_workers=False)
            return super().__iter__()


def spans_epochs(d: DataConfig) -> bool:
    """Whether one loader of the source ``d`` (the data section) can span several epochs
    (``make_dataloader(epochs=...)``): every epoch of it has the same number of batches."""
    return d.factory is None and d.source in ("synthetic", "binary", "criteo_npy")


def epoch_batches(batches: Iterable[Any], first: int, per_epoch: int) -> Iterator[Iterator[Any]]:
    """One iterator per epoch over ``batches`` (a loader spanning epochs): ``first`` batches,
    then ``per_epoch`` each; an epoch's iterator must be used up (or dropped) before the next
    is taken. They share one iterator of ``batches``, whose producers run on across the
    epochs' boundaries."""
    started: list[Iterator[Any]] = []

    def epoch(count: int) -> Iterator[Any]:
        if not started:  # iter() where the first epoch is read: a loader that fails to start raises there
            started.append(iter(batches))
        yield from itertools.islice(started[0], count)

    yield epoch(first)
    while True:
        yield epoch(per_epoch)


class _EpochIndex:
    """Batch ``g`` of a binary or criteo_npy loader spanning epochs from ``epoch``: (index in
    its epoch, that epoch's block order, the epoch); each epoch's order is drawn once."""

    def __init__(self, dataset: Any, epoch: int) -> None:
        self.dataset, self.epoch, self.orders = dataset, epoch, {}

    def __call__(self, g: int) -> tuple[int, Any, int]:
        offset, index = divmod(g, self.dataset.num_batches)
        epoch = self.epoch + offset
        order = self.orders.get(epoch)
        if order is None:
            order = self.dataset.block_order(epoch)
            # Rebound, not changed in place (producer threads share it); the epochs come in order.
            self.orders = {e: o for e, o in self.orders.items() if e >= epoch - 1} | {epoch: order}
        return index, order, epoch


class _SyntheticBatch:
    """``index -> batch`` of one rank's synthetic split (pinned when ``pin``).

    ``device`` (``data.synthetic.device``, resolved): None makes it on the host; a CUDA
    device makes it there on the calling thread's own stream, copies it into host memory
    and waits for that stream alone (never the training loop's), so a host batch is
    handed over as from the host path; the CPU device runs the same torch path on the host."""

    def __init__(self, spec: DataSpec, rank: int, split: str, epoch: int, pin: bool,
                 device: torch.device | None = None, per_epoch: int = 0) -> None:
        self.log, self.rank, self.split, self.epoch, self.pin = SyntheticClickLog(spec), rank, split, epoch, pin
        self.device, self.per_epoch = device, per_epoch
        self.streams = threading.local()  # each producer thread's CUDA stream

    def __call__(self, index: int) -> Batch:
        epoch, index = divmod(index, self.per_epoch) if self.per_epoch else (0, index)  # batch ``index`` of the stream
        make = functools.partial(self.log.batch, rank=self.rank, split=self.split, epoch=self.epoch + epoch, index=index)
        if self.device is None or self.device.type != "cuda":
            batch = make(device=self.device)
            return batch.pin_memory() if self.pin else batch
        stream = getattr(self.streams, "stream", None)
        if stream is None:
            stream = self.streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            batch = _to_host(make(device=self.device), self.pin)
        stream.synchronize()
        return batch


def _to_host(batch: Batch, pin: bool) -> Batch:
    """``batch`` copied into new host tensors (pinned: the copies are queued, not waited for)."""
    def copied(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)

    kjt = batch.sparse_features
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=copied(kjt.values()), lengths=copied(kjt.lengths()),
                               stride=kjt.stride(), length_per_key=kjt.length_per_key())
    return Batch(dense_features=copied(batch.dense_features), sparse_features=sparse,
                 labels=copied(batch.labels), weights=copied(batch.weights))


def synthetic_device(d: DataConfig) -> torch.device | None:
    """Where synthetic batches are made (``d``: the ``data`` section): None on the host,
    or the rank's current CUDA device for ``data.synthetic.device: cuda``."""
    if d.source != "synthetic" or d.factory is not None or d.synthetic.device == "cpu":
        return None
    if not torch.cuda.is_available():
        raise ConfigError("data.synthetic.device='cuda' but this process has no CUDA GPU (torch.cuda.is_available() "
                          "is false): use data.synthetic.device='cpu'")
    return torch.device("cuda", torch.cuda.current_device())


def host_memory_tables(cfg: RecpipeConfig) -> list[str]:
    """Tables whose weights live in pinned host memory (UVM kernels)."""
    return sorted(n for n, t in cfg.table_sharding().items() if t.kernel in ("fused_uvm", "fused_uvm_caching"))


def workers_kind_of(cfg: RecpipeConfig) -> str:
    """``data.workers_kind`` where it applies (a warning where a set value does not).

    Tables in UVM make the batch producers threads: their weights are pinned host
    memory, and Linux does not share pinned pages copy-on-write with a forked child;
    it copies them (docs/data.md, "Loader processes and threads"); threads need no fork at all."""
    d = cfg.data
    if d.synthetic.device == "cuda":  # a forked process cannot use the parent's CUDA context
        if "workers_kind" in d.model_fields_set and d.workers_kind == "process":
            job_warning("data.workers_kind='process' is ignored: data.synthetic.device='cuda' makes the batches in "
                        "threads of the training process, on its GPU", stacklevel=3)
        return "thread"
    if "workers_kind" in d.model_fields_set and (d.source == "criteo_tsv" or d.num_workers in (0, "auto")):
        why = ("criteo_tsv always parses in forked DataLoader worker processes" if d.source == "criteo_tsv"
               else "data.num_workers=0 makes the batches in the training loop")
        job_warning(f"data.workers_kind={d.workers_kind!r} is ignored: {why}", stacklevel=3)
    if d.num_workers in (0, "auto"):
        return d.workers_kind
    host = host_memory_tables(cfg) if d.workers_kind == "process" else []
    if host:
        if "workers_kind" in d.model_fields_set:
            job_warning(f"data.workers_kind='process' is replaced by 'thread': tables {', '.join(host)} are in UVM "
                        "(pinned host memory), which every forked producer would copy", stacklevel=3)
        return "thread"
    return workers_kind(d.workers_kind)


def workers_description(cfg: RecpipeConfig) -> str:
    """What makes the batches: "made in the loop", "DataLoader worker processes", "producer processes"
    or "producer threads" (``data.num_workers`` a number)."""
    d = cfg.data
    if d.num_workers == 0:
        return "made in the loop"
    if d.source == "criteo_tsv":
        return "DataLoader worker processes"
    if d.synthetic.device == "cuda":
        return "producer threads on the GPU"
    return {"process": "producer processes", "thread": "producer threads"}[workers_kind_of(cfg)]


def _on_cpu(device: str) -> bool:
    """Whether ``train.device`` (``device``) trains on the CPU here."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def size_loader(cfg: RecpipeConfig, *, rank: int, world_size: int) -> WorkersSizing:
    """``data.num_workers: auto`` for ``rank``: the time to make a batch of its training split,
    measured here (the second and third batch of a loader without producers: the first
    pays the source's start), and the cores it has (``recpipe.data.workers``)."""
    cores, on_cpu = rank_cores(local_world_size(world_size)), _on_cpu(cfg.train.device)
    if cfg.data.factory is not None:  # a user's batches: data.num_workers does not apply
        return WorkersSizing(workers=0, cores=cores, batch_seconds=None, needed=0)
    one = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": 0, "pin_memory": False})})
    seconds = None
    try:
        batches = iter(make_dataloader(one, rank=rank, world_size=world_size, split="train"))
        if next(batches, None) is not None:
            started, made = time.perf_counter(), sum(1 for _ in itertools.islice(batches, 2))
            seconds = (time.perf_counter() - started) / made if made else None
    except (ValueError, OSError, DataError, BinaryDataError):  # reported where training reads the data
        pass
    if cfg.data.synthetic.device == "cuda":
        return size_gpu_workers(cores=cores, batch_seconds=seconds, batch_size=cfg.data.batch_size)
    return size_workers(cores=cores, batch_seconds=seconds, batch_size=cfg.data.batch_size, on_cpu=on_cpu)


def with_sized_workers(cfg: RecpipeConfig, *, rank: int, world_size: int) -> tuple[RecpipeConfig, WorkersSizing | None]:
    """``cfg`` with ``data.num_workers: auto`` replaced by the producers :func:`size_loader`
    chose (and that choice), or as it is when the number is set."""
    if cfg.data.num_workers != "auto":
        return cfg, None
    sizing = size_loader(cfg, rank=rank, world_size=world_size)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": sizing.workers})}), sizing


def make_dataloader(
    cfg: RecpipeConfig,
    *,
    rank: int,
    world_size: int,
    split: Literal["train", "eval"],
    epoch: int = 0,
    start_batch: int = 0,
    epochs: int = 1,
) -> Iterable[Any]:
    """An iterable over ``rank``'s ``split`` batches from index ``start_batch`` on
    (with ``data.factory``: whatever the user's function returns for the same arguments).

    ``epochs`` > 1 (synthetic, binary, criteo_npy: see :func:`spans_epochs`): the batches of
    epochs ``epoch .. epoch + epochs - 1`` one after the other, each epoch's as its own loader
    gives them, from one set of producers: they make the next epoch's first batches while the
    last of this one train (a loader per epoch forks its producers anew and waits for its first
    batch, on the training loop's time). :func:`epoch_batches` splits it by epoch."""
    _check(rank, world_size, split)
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")
    if epochs > 1 and not spans_epochs(cfg.data):
        raise ValueError(f"data.source={cfg.data.source!r} makes one loader per epoch (epochs={epochs})")
    if cfg.data.factory is not None:
        return user_batches(cfg, rank=rank, world_size=world_size, split=split, epoch=epoch, start_batch=start_batch)
    cfg = with_sized_workers(cfg, rank=rank, world_size=world_size)[0]
    d, spec = cfg.data, DataSpec.from_config(cfg)
    pin = d.pin_memory and torch.cuda.is_available()
    pin_device = torch.device("cuda", torch.cuda.current_device()) if pin else None
    workers, kind = d.num_workers, workers_kind_of(cfg)
    # Producer processes must not touch CUDA: their batches are pinned when they arrive.
    pin_made = pin and not (workers > 0 and kind == "process")
    if d.source == "synthetic":
        per_epoch = num_synthetic_batches(d.synthetic, rank=rank, split=split)
        make = _SyntheticBatch(spec, rank, split, epoch, pin_made, synthetic_device(d), per_epoch)
        return BatchStream(make, start_batch, per_epoch * epochs, workers, pin_device, kind)
    if d.source in ("binary", "criteo_npy"):
        if d.source == "binary" and _binary_dir(d, split) is None:
            return []
        if d.source == "criteo_npy" and not _npy_days(d, split):
            return []
        dataset = (_binary_dataset if d.source == "binary" else _npy_dataset)(
            d, spec, rank=rank, world_size=world_size, split=split)
        at = _EpochIndex(dataset, epoch)
        make = lambda g: dataset.batch(*at(g), pin=pin_made)  # noqa: E731  (threads or fork: no pickling)
        make_into = lambda g, empty: dataset.batch(*at(g), empty=empty)  # noqa: E731
        return BatchStream(make, start_batch, dataset.num_batches * epochs, workers, pin_device, kind, make_into)
    reader = CriteoTsvReader(spec, _tsv_files(d, split), rank=rank, world_size=world_size)
    # Spawned workers where tables are in UVM: a fork of this process would copy their
    # pinned host memory into every worker (see workers_kind_of).
    context = None if "fork" not in multiprocessing.get_all_start_methods() else "spawn" if host_memory_tables(cfg) else "fork"
    return TsvDataLoader(
        CriteoTsvDataset(reader, start_batch=start_batch),
        batch_size=None,
        num_workers=workers,
        collate_fn=identity_collate,
        pin_memory=pin,
        worker_init_fn=functools.partial(init_worker, parent_pid=os.getpid()) if workers > 0 else None,
        multiprocessing_context=context if workers > 0 else None,
        persistent_workers=False,
    )
