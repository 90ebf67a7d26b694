"""FBGEMM's backward pre-hook work for batch i on the prefetch stream right after
prefetch(i+1), not on the compute stream inside backward(i): applied by
:func:`apply_cache_bookkeeping` to every pipeline with a prefetch step
(``recpipe.capabilities.PREFETCH_STEP``) and locked UVM caches.

With ``prefetch_pipeline`` FBGEMM (1.6 to 1.8) registers
``_update_cache_counter_and_locations`` as a full backward pre-hook of every cached TBE.
Inside backward(i), before the TBE backward, it

1. makes the compute stream wait for the prefetch stream (prefetch(i+1) is done);
2. decrements the cache-line locks batch i took (``lxu_cache_locking_counter_decrement``
   over batch i's cache locations);
3. recomputes batch i's cache locations (linearize, sort-unique, ``lxu_cache_lookup``):
   prefetch(i+1) may have inserted rows that batch i missed, and the backward must then
   update the cached copy, not the host row.

2 and 3 are a dozen small kernels, a small share of the compute stream's step. Moving
them gains about the spread of identical runs (docs/pipelines.md, "FBGEMM's backward
bookkeeping on the prefetch stream"), so it is not an option; the
memory planner models this placement (its ``cache_bookkeeping`` phase on the prefetch
stream). They read only the cache
state after prefetch(i+1), batch i's inputs and batch i's locations, and they overwrite
those locations, which forward(i)'s TBE lookup reads. So here they run on the prefetch
stream right after prefetch(i+1), once forward(i)'s TBE lookup is done (an event recorded
by a forward hook); the pre-hook keeps 1, which now waits for them too. The same ops in
the same order on the cache state: the same numbers (GPU test: the prefetch pipeline
trains bit-identically to the same model in HBM).

The pre-hook falls back to FBGEMM's whole hook when no prefetch followed the forward
(the last batch of a pass; training outside the pipeline), and recomputes the locations
again (3 only) if another prefetch ran after the early work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from recpipe.compat.fbgemm import tbe_last_batch
from recpipe.compat.torch import backward_pre_hooks
from recpipe.runtime.sharded import cached_tbes
from recpipe.runtime.streams import hand_off, record_event

FBGEMM_HOOK = "_update_cache_counter_and_locations"
_ATTR = "_recpipe_cache_bookkeeping"


@dataclass
class _Batch:
    """What FBGEMM's hook reads, as the forward left it, and the forward's end on the compute stream."""

    forward_done: Any  # CUDA event after the TBE's forward (its lookup reads ``locations``)
    locations: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    vbe_b_offsets: Optional[torch.Tensor]
    vbe_max_b: int
    early_at: Optional[int] = None  # tbe.timestep when the early work ran; None: not run


@dataclass
class _State:
    fbgemm_hook: Callable[..., Any]
    pending: Optional[_Batch] = None  # the last training forward's, until its backward


def install(tbe: torch.nn.Module) -> bool:
    """Replace FBGEMM's backward pre-hook of ``tbe`` with :func:`_before_backward` and
    record each training forward (:func:`_after_forward`). Idempotent; False when the TBE
    has no such hook (no ``prefetch_pipeline``, or a FBGEMM that names it otherwise)."""
    if getattr(tbe, _ATTR, None) is not None:
        return True
    hooks = backward_pre_hooks(tbe)
    key = next((k for k, h in hooks.items()
                if getattr(h, "__self__", None) is tbe and getattr(h, "__name__", "") == FBGEMM_HOOK), None)
    if key is None:
        return False
    state = _State(fbgemm_hook=hooks[key])
    hooks[key] = functools.partial(_before_backward, state)
    tbe.register_forward_hook(functools.partial(_after_forward, state))
    setattr(tbe, _ATTR, state)
    return True


def _after_forward(state: _State, tbe: torch.nn.Module, args: Any, output: Any) -> None:
    if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
        return  # no backward will follow: FBGEMM's hook will not run either
    state.pending = _Batch(record_event(_current_stream(output)), tbe.lxu_cache_locations, *tbe_last_batch(tbe))


def _current_stream(t: torch.Tensor) -> Any:
    return torch.cuda.current_stream(t.device) if t.is_cuda else None  # None: CPU, every fence a no-op


def after_prefetch(tbe: torch.nn.Module) -> None:
    """On the prefetch stream, right after the prefetch of the next batch: FBGEMM's hook
    work (2, 3) for the batch whose backward comes next, if any and not done yet."""
    state: Optional[_State] = getattr(tbe, _ATTR, None)
    b = state.pending if state is not None else None
    if b is None or b.early_at is not None:
        return
    # forward(i)'s lookup has read the locations; its inputs (made on the dist or compute
    # stream) are used here too
    hand_off([b.locations, b.indices, b.offsets, b.vbe_b_offsets], _current_stream(b.locations), after=b.forward_done)
    _release(tbe, b)
    _relookup(tbe, b)
    b.early_at = tbe.timestep


def _release(tbe: torch.nn.Module, b: _Batch) -> None:
    """FBGEMM's hook, step 2: batch b's cache-line locks released."""
    torch.ops.fbgemm.lxu_cache_locking_counter_decrement(tbe.lxu_cache_locking_counter, b.locations)


def _relookup(tbe: torch.nn.Module, b: _Batch) -> None:
    """FBGEMM's hook, step 3: batch b's cache locations in the cache as it is now."""
    linear = torch.ops.fbgemm.linearize_cache_indices(tbe.cache_hash_size_cumsum, b.indices, b.offsets,
                                                      b.vbe_b_offsets, b.vbe_max_b)
    unique, length, _ = torch.ops.fbgemm.get_unique_indices(linear, tbe.total_cache_hash_size, compute_count=False)
    torch.ops.fbgemm.lxu_cache_lookup(unique, tbe.lxu_cache_state, tbe.total_cache_hash_size,
                                      gather_cache_stats=False, num_uniq_cache_indices=length,
                                      lxu_cache_locations_output=b.locations)


def _before_backward(state: _State, tbe: torch.nn.Module, grad_output: Any) -> Any:
    b, state.pending = state.pending, None
    if b is None or b.early_at is None or b.locations is not tbe.lxu_cache_locations:
        return state.fbgemm_hook(tbe, grad_output)
    if tbe.prefetch_stream is not None:  # FBGEMM's step 1: the prefetch, and the early work after it
        hand_off(None, _current_stream(b.locations), after=record_event(tbe.prefetch_stream))
    if b.early_at != tbe.timestep:  # a prefetch ran after the early work: the cache changed again
        _relookup(tbe, b)
    return None


def clear(tbe: torch.nn.Module) -> None:
    """Forget the pending batch (the pipeline released every cache-line lock)."""
    state: Optional[_State] = getattr(tbe, _ATTR, None)
    if state is not None:
        state.pending = None


@dataclass(frozen=True)
class CacheBookkeeping:
    """What :func:`apply_cache_bookkeeping` installed."""

    tbes: int

    def __repr__(self) -> str:
        return (f"cache bookkeeping: FBGEMM's backward pre-hook work of {self.tbes} cached TBEs on the prefetch "
                "stream (recpipe.speedups.cache_bookkeeping)")


def apply_cache_bookkeeping(pipeline: Any, tbes: list) -> CacheBookkeeping | None:
    """Move the backward pre-hook work of ``tbes`` (the pipeline's locked UVM caches) to right
    after each prefetch step (``pipeline.wrap_step``; ``pipeline``: a pipeline or its step
    context) and forget a pending batch when a ``detached()`` block ends (the pipeline then
    released every cache-line lock); TBEs whose FBGEMM hook is not found keep it. None when
    there is nothing to move."""
    moved = tuple(t for t in tbes if install(t))
    if not moved:
        return None

    def then_bookkeeping(step: Callable) -> Callable:
        def prefetch(ctx: Any, batch: Any) -> None:
            step(ctx, batch)
            for tbe in moved:
                after_prefetch(tbe)

        return prefetch

    pipeline.wrap_step("prefetch", then_bookkeeping)
    pipeline.on_detached(lambda: [clear(tbe) for tbe in moved])
    return CacheBookkeeping(len(moved))


def apply(ctx: Any, options: None) -> CacheBookkeeping | None:
    """The speed feature's entry point (``recpipe.speedups.defs.cache_bookkeeping``): the
    model's locked UVM caches."""
    return apply_cache_bookkeeping(ctx, cached_tbes(ctx.model))
