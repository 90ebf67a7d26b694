"""recpipe.speedups.cache_bookkeeping on CPU: when FBGEMM's backward pre-hook work runs.

A stand-in TBE registers a hook under FBGEMM's name; FBGEMM's cache ops are recorded
instead of run (they need CUDA). The GPU tests run the real thing: the prefetch pipeline
trains bit-identically to HBM with it (tests/test_pipelines_gpu.py)."""

import pytest
import torch

from recpipe.speedups import cache_bookkeeping as bk


class FakeTBE(torch.nn.Module):
    """The attributes FBGEMM's hook reads, as its forward and prefetch leave them."""

    def __init__(self, calls):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.calls = calls
        self.timestep = 0
        self.prefetch_stream = None
        self.lxu_cache_locking_counter = torch.zeros(5, dtype=torch.int32)
        self.register_full_backward_pre_hook(self._update_cache_counter_and_locations)

    def _update_cache_counter_and_locations(self, module, grad_output):
        self.calls.append(("fbgemm_hook", self.lxu_cache_locations))

    def prefetch(self):
        self.timestep += 1

    def forward(self, ids):
        self._indices, self._offsets = ids, torch.arange(ids.numel() + 1)
        self._vbe_B_offsets, self._vbe_max_B = None, -1
        self.lxu_cache_locations = ids.to(torch.int32) + 100  # a new tensor every forward
        return self.weight.sum() * ids.float()


@pytest.fixture
def tbe(monkeypatch):
    calls = []
    monkeypatch.setattr(bk, "_release", lambda t, b: calls.append(("release", b.locations)))
    monkeypatch.setattr(bk, "_relookup", lambda t, b: calls.append(("relookup", b.locations)))
    module = FakeTBE(calls)
    assert bk.install(module)
    return module


def _step(tbe, ids, prefetches=1, early=True):
    """forward(i); the prefetch(es) of the next batch (with the early work after the first); backward(i)."""
    out = tbe(ids)
    locations = tbe.lxu_cache_locations
    for n in range(prefetches):
        tbe.prefetch()
        if early and n == 0:
            bk.after_prefetch(tbe)
    out.sum().backward()
    return locations


def test_install_replaces_fbgemm_hook_once_and_only_where_it_is():
    calls = []
    module = FakeTBE(calls)
    assert bk.install(module) and bk.install(module)
    assert len(module._backward_pre_hooks) == 1 and len(module._forward_hooks) == 1
    plain = torch.nn.Linear(2, 2)
    assert not bk.install(plain)
    assert not plain._forward_hooks and not plain._backward_pre_hooks


def test_hook_work_runs_after_the_prefetch_not_in_the_backward(tbe):
    locations = _step(tbe, torch.tensor([1, 2, 3]))
    assert [name for name, _ in tbe.calls] == ["release", "relookup"]
    assert all(t is locations for _, t in tbe.calls), "the early work must use the forward's own locations"


def test_no_prefetch_after_the_forward_falls_back_to_fbgemms_hook(tbe):
    locations = _step(tbe, torch.tensor([1, 2]), prefetches=0)
    assert tbe.calls == [("fbgemm_hook", locations)]


def test_a_second_prefetch_before_the_backward_redoes_the_lookup_only(tbe):
    _step(tbe, torch.tensor([4, 5]), prefetches=2)
    assert [name for name, _ in tbe.calls] == ["release", "relookup", "relookup"]


def test_early_work_runs_once_per_forward(tbe):
    tbe(torch.tensor([1])).sum().backward()  # last batch of a pass: FBGEMM's hook
    out = tbe(torch.tensor([2]))
    tbe.prefetch()
    bk.after_prefetch(tbe)
    bk.after_prefetch(tbe)  # a second call for the same forward does nothing
    out.sum().backward()
    bk.after_prefetch(tbe)  # after the backward nothing is pending
    assert [name for name, _ in tbe.calls] == ["fbgemm_hook", "release", "relookup"]


def test_forward_without_grad_leaves_nothing_pending(tbe):
    with torch.no_grad():
        tbe(torch.tensor([1, 2]))
    tbe.prefetch()
    bk.after_prefetch(tbe)
    assert tbe.calls == []


def test_clear_drops_the_pending_batch(tbe):
    out = tbe(torch.tensor([1, 2]))
    bk.clear(tbe)
    bk.after_prefetch(tbe)
    out.sum().backward()
    assert [name for name, _ in tbe.calls] == ["fbgemm_hook"]
