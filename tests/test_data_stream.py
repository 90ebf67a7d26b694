"""recpipe.data.stream: batches made by threads or forked processes arrive in index
order, bit for bit as made in line; errors, killed producers and abandoned
iterators are handled, and no producer process outlives its iterator."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.data.batch import Batch
from recpipe.data.flat import KJT_FIELDS, flatten_batch, unflatten_batch
from recpipe.data.processes import ProducerDied
from recpipe.data.stream import BatchStream

KINDS = ["thread", "process"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_order_is_the_index_order_whatever_the_threads(workers, kind):
    def make(i):
        time.sleep(0.001 * (i % 3))  # finish out of order
        return i * i

    assert list(BatchStream(make, 2, 11, workers, kind=kind)) == [i * i for i in range(2, 11)]
    assert list(BatchStream(make, 5, 5, workers, kind=kind)) == []
    assert len(BatchStream(make, 2, 11, workers, kind=kind)) == 9


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_is_raised_at_its_batch(workers, kind):
    def make(i):
        if i == 3:
            raise ValueError("batch 3 is broken")
        return i

    it = iter(BatchStream(make, 0, 10, workers, kind=kind))
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch 3 is broken") as caught:
        next(it)
    if kind == "process" and workers:  # where it happened, in the notes of the traceback
        assert "raised in recpipe batch producer process 1 of 2" in caught.value.__notes__[0]


class _Unpicklable(Exception):
    def __init__(self, a, b):  # unpickling calls _Unpicklable(message): fails
        super().__init__(f"{a} and {b}")


def test_an_exception_that_cannot_be_unpickled_arrives_as_its_text():
    def make(i):
        if i == 1:
            raise _Unpicklable("this", "that")
        return i

    it = iter(BatchStream(make, 0, 4, 1, kind="process"))
    assert next(it) == 0
    with pytest.raises(RuntimeError, match="_Unpicklable: this and that"):
        next(it)


def _reaped(pid: int) -> bool:
    """Not (or no longer) a child of this process: no zombie left behind."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_a_killed_producer_is_an_error_naming_it():
    def make(i):
        if i == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # producer 1 of 2 dies making batch 3
        return i

    it = iter(BatchStream(make, 0, 10, 2, kind="process"))
    pids = [c.pid for c in it.producers.children]
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    with pytest.raises(ProducerDied, match=rf"producer process 1 of 2 \(pid {pids[1]}\) was killed by signal 9 "
                                           r"\(SIGKILL\).* before handing over batch 3"):
        next(it)
    assert all(_reaped(pid) for pid in pids)


def test_producers_ignore_sigint_and_sigterm():
    """Ctrl-C and SLURM signal the whole process group; the trainer reads batches
    until its ranks agree to stop, so the producers must not die of it."""
    def make(i):
        time.sleep(0.002)
        return i

    it = iter(BatchStream(make, 0, 40, 2, kind="process"))
    assert next(it) == 0
    for child in it.producers.children:
        os.kill(child.pid, signal.SIGTERM)
        os.kill(child.pid, signal.SIGINT)
    assert list(it) == list(range(1, 40))


def test_an_abandoned_iterator_stops_its_threads():
    it = iter(BatchStream(lambda i: i, 0, 10_000, 2, kind="thread"))
    assert next(it) == 0
    threads = list(it.producers.threads)
    del it
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("how", ["dropped", "closed", "finished"])
def test_producer_processes_are_reaped_when_the_iterator_ends(how):
    it = iter(BatchStream(lambda i: i, 0, 10_000 if how != "finished" else 6, 2, kind="process"))
    assert next(it) == 0
    pids = [c.pid for c in it.producers.children]
    receiver = it.producers.thread
    if how == "dropped":
        del it
        gc.collect()
    elif how == "closed":
        it.close()
    else:
        assert list(it) == [1, 2, 3, 4, 5]
    receiver.join(timeout=5)
    assert not receiver.is_alive()
    assert all(_reaped(pid) for pid in pids)


def _batch(n: int, weights: bool = False) -> Batch:
    """A batch of 4 samples whose ids take ``n`` values (any size: slots must grow)."""
    g = torch.Generator().manual_seed(n)
    lengths = torch.full((2 * 4,), n // 8, dtype=torch.int32)
    lengths[0] += n - int(lengths.sum())
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.randint(0, 1 << 40, (n,), generator=g),
                            lengths=lengths, weights=torch.rand(n, generator=g) if weights else None, stride=4)
    return Batch(torch.rand(4, 3, generator=g), kjt, torch.rand(4, generator=g), torch.ones(4))


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, tuple):  # inverse_indices
        return isinstance(y, tuple) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


def _assert_same(a: Batch, b: Batch) -> None:
    for name in ("dense_features", "labels", "weights"):
        assert _same(getattr(a, name), getattr(b, name)), name
    for field in KJT_FIELDS:
        assert _same(getattr(a.sparse_features, "_" + field), getattr(b.sparse_features, "_" + field)), field


def test_flatten_keeps_every_field_of_the_batch_and_its_kjt():
    batch = _batch(40, weights=True)
    kjt = batch.sparse_features
    kjt.offsets(), kjt.length_per_key(), kjt.offset_per_key()  # cached fields travel too
    kjt._inverse_indices = (["a", "b"], torch.arange(8).view(2, 4))
    assert {"keys", "values", "weights", "lengths", "offsets", "stride", "length_per_key", "inverse_indices"} <= set(KJT_FIELDS)
    tensors, spec = flatten_batch(batch)
    copies = [t.clone() for t in tensors]
    rebuilt = unflatten_batch(spec, copies)
    _assert_same(rebuilt, batch)
    assert rebuilt.sparse_features._inverse_indices[0] == ["a", "b"] and rebuilt.sparse_features._stride == 4
    assert any(rebuilt.sparse_features.values() is c for c in copies)  # built on the tensors, not copied


def test_batches_larger_than_their_slot_arrive_whole():
    sizes = [10, 3, 50, 7, 400, 9000, 20, 100_000]  # each producer's slots must grow several times
    make = lambda i: _batch(sizes[i], weights=i % 2 == 1)  # noqa: E731
    got = list(BatchStream(make, 0, len(sizes), 2, kind="process"))
    assert len(got) == len(sizes)
    for i, b in enumerate(got):
        _assert_same(b, make(i))


def _batch_into(n: int, empty, weights: bool) -> Batch:
    """``_batch(n)`` with its ids and dense features allocated by ``empty`` (``make_into``)."""
    b = _batch(n, weights)
    kjt = b.sparse_features
    values = empty(tuple(kjt.values().shape), kjt.values().dtype)
    values.copy_(kjt.values())
    dense = empty(tuple(b.dense_features.shape), torch.float32)
    dense.copy_(b.dense_features)
    return Batch(dense, KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(),
                                          weights=kjt.weights_or_none(), stride=4), b.labels, b.weights)


@pytest.mark.parametrize("workers", [1, 2])
def test_batches_made_in_their_slot_arrive_as_made_also_when_it_must_grow(tmp_path, workers):
    """``make_into``: the producer hands ``empty`` views of the free slot (a tensor made there
    is not copied); a batch that does not fit is made elsewhere and copied into a larger slot."""
    sizes = [10] * 6 + [9000] * 6 + [100_000] * 6 + [10] * 6
    odd = lambda i: i % 2 == 1  # noqa: E731

    def into(i, empty):
        batch = _batch_into(sizes[i], empty, odd(i))
        if batch.sparse_features.values().untyped_storage().nbytes() > batch.sparse_features.values().nbytes:
            (tmp_path / f"in-slot-{i}").touch()  # a view of a larger buffer: the slot's segment
        return batch

    got = list(BatchStream(lambda i: _batch(sizes[i], odd(i)), 0, len(sizes), workers, kind="process", make_into=into))
    assert len(got) == len(sizes)
    for i, b in enumerate(got):
        _assert_same(b, _batch(sizes[i], odd(i)))
    in_slot = {int(p.name.split("-")[-1]) for p in tmp_path.glob("in-slot-*")}
    assert in_slot and in_slot < set(range(len(sizes)))  # some made in place, the first ones (no slot yet) not
    assert not in_slot & set(range(3 * workers))


_PARENT_SCRIPT = """
import atexit, os, sys, time
pids = []

def reaped_at_exit():  # registered first, so it runs after recpipe's exit hook
    def reaped(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return False
    print("reaped" if all(reaped(p) for p in pids) else "NOT reaped", flush=True)

atexit.register(reaped_at_exit)
sys.path.insert(0, {root!r})
from recpipe.data.stream import BatchStream

def make(i):
    time.sleep(0.01)
    return i

it = iter(BatchStream(make, 0, 100_000, 2, kind="process"))
next(it)
pids += [c.pid for c in it.producers.children]
print(" ".join(map(str, pids)), flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)  # without closing the iterator
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie whose parent has not reaped it yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_producer_processes_do_not_outlive_the_training_process(tmp_path):
    """A training process that exits without closing its iterator reaps its producers
    (exit hook); one that is killed takes them with it (PR_SET_PDEATHSIG)."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_PARENT_SCRIPT.format(root=str(Path(__file__).parents[1]))))
    parents = {how: subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for how in ("exit", "killed")}
    pids = {how: [int(p) for p in proc.stdout.readline().split()] for how, proc in parents.items()}
    assert [len(p) for p in pids.values()] == [2, 2]
    parents["killed"].send_signal(signal.SIGKILL)
    out, err = parents["exit"].communicate(timeout=60)
    assert parents["exit"].returncode == 0 and out.strip() == "reaped", (out, err)
    assert "Traceback" not in err and "recpipe" not in err, err  # the producers printed nothing
    parents["killed"].communicate(timeout=60)
    assert parents["killed"].returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids["killed"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids["killed"] + pids["exit"])


def _touches_cuda(i):
    return torch.ones(1, device="cuda").item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_producers_fork_from_a_cuda_process_and_must_not_touch_cuda():
    torch.ones(1, device="cuda")  # CUDA initialized before the fork, as in a trainer
    assert list(BatchStream(lambda i: i, 0, 5, 2, kind="process")) == list(range(5))
    with pytest.raises(RuntimeError, match="Cannot re-initialize CUDA in forked subprocess"):
        list(BatchStream(_touches_cuda, 0, 5, 2, kind="process"))
