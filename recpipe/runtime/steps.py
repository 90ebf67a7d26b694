"""The steps a schedule is made of, as free functions ``step(ctx, batch)``.

``ctx`` is the pipeline's :class:`~recpipe.runtime.engine.StepContext`: what a step may
use of the engine (model, optimizer, streams, sharded modules and their input sources,
the batch in forward, recent batches, the pipeline's hooks).

The engine runs each under its stream (``use_stream``) after the fences its
``Step.waits`` name, and records an event right after it when a fence on another
stream waits for it. A step that waits for its batch's ``h2d`` on another stream reads
the batch's device copy: the engine hands that copy to the step's stream before it runs
(``record_stream``). Inside, a step only has to hand the other objects it reads from
another stream to its own (``streams.hand_off`` / ``Streams.hand_over``: the input
all-to-all's output, an early lookup's embeddings; nothing when the two are the same
stream).
The sharded modules' part of forward is ``sharded_forward``, called by the
interceptors in ``recpipe.runtime.sharded``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recpipe.compat import torch as compat_torch
from recpipe.runtime.inputs import BatchPath
from recpipe.runtime.pooled import GroupedKeyedTensor, grouped
from recpipe.errors import PipelineError
from recpipe.runtime.sharded import fuse_splits, install_splits_only
from recpipe.runtime.streams import hand_off, use_stream

if TYPE_CHECKING:
    from recpipe.runtime.context import InFlight, StepContext


def h2d(ctx: "StepContext", b: "InFlight") -> None:
    """Copy the host batch on the memcpy stream (pinned host memory makes it async).

    With ``max_batches_ahead=k`` the copy of batch j first waits for the end of
    batch j-k's step, so at most k batches' device buffers are allocated ahead.
    """
    if ctx.max_batches_ahead is not None:
        older = ctx.recent(b.index - ctx.max_batches_ahead)
        if older is not None and older is not b:
            hand_off(None, ctx.streams.memcpy, after=older.events.get("optimizer"))
    for source in (ctx.sources or {}).values():
        # ids per key summed on the host copy: the copy carries them to the device, where
        # torchrec's input dist would read them back (``length_per_key()`` in
        # ``KeyedJaggedTensor.permute``, a host sync) if the batch came without them
        if isinstance(source, BatchPath):
            kjt = source.get(b.host)
            if isinstance(kjt, KeyedJaggedTensor) and kjt.device().type == "cpu":
                kjt.length_per_key()
    b.device = b.host.to(ctx.device, non_blocking=True)


def input_dist(ctx: "StepContext", b: "InFlight") -> None:
    """Launch the splits all-to-all of every sharded module's input dists: one fused
    collective per process group once the input dists exist (the first batch
    creates them and goes unfused)."""
    requests = {}
    for fqn, module in ctx.modules.items():
        # The KJT at the module's path in the batch, or the user's inputs= function
        # run here, on the dist stream, ahead of forward.
        features = ctx.sources[fqn].get(b.device)
        b.ctxs[fqn] = module.create_context()
        requests[fqn] = module.input_dist(b.ctxs[fqn], features)
    b.splits = fuse_splits(requests, b.ctxs)
    if not ctx.splits_fused:
        ctx.splits_fused = install_splits_only(ctx.modules)


def input_dist_wait(ctx: "StepContext", b: "InFlight") -> None:
    """Host sync: the splits wait() does .tolist() on the received splits, then
    launches the values/lengths all-to-alls. Scheduled after a forward has been
    queued so the GPU has work while the host waits."""
    for fqns, fused in b.splits:
        for fqn, tensors_awaitable in zip(fqns, fused.wait()):
            b.dist_in[fqn] = tensors_awaitable
    b.splits = []


def _dist_input(ctx: "StepContext", b: "InFlight", fqn: str) -> Any:
    """The module's KJTList on the dist stream (waiting its all-to-all if pending)."""
    data = b.dist_in[fqn]
    if hasattr(data, "wait"):
        with use_stream(ctx.streams.dist, ctx.stream):
            data = data.wait()
        b.dist_in[fqn] = data
    return data


def lookup(ctx: "StepContext", b: "InFlight") -> None:
    """TBE lookup + output all-to-all launch for every module, ahead of forward."""
    stream = ctx.step_stream(b, "lookup")
    for fqn, module in ctx.modules.items():
        data = _dist_input(ctx, b, fqn)
        # The input all-to-all's output, made on dist; nothing to do when the lookup
        # runs on dist too (emb_lookup_stream=data_dist, the default).
        ctx.streams.hand_over([data, b.ctxs[fqn]], ctx.streams.dist, stream)
        b.emb[fqn] = grouped(module.compute_and_output_dist(b.ctxs[fqn], data))
        del b.dist_in[fqn]


def output_dist_wait(ctx: "StepContext", b: "InFlight") -> None:
    """Wait for the early lookups' output all-to-alls on this step's stream (the lookup's:
    torchrec allocated the all-to-all's buffers there and frees them inside the wait).
    torchrec drops the all-to-all's input (the lookup's output) once it is waited, so
    the allocator can reuse it as soon as the all-to-all is done on the GPU."""
    for fqn in list(b.emb):
        b.emb_ready[fqn] = b.emb.pop(fqn).wait()


def prefetch(ctx: "StepContext", b: "InFlight") -> None:
    """FBGEMM UVM-cache prefetch of batch b on the prefetch stream.

    ``forward_stream`` is the real compute stream: FBGEMM records its prefetched
    tensors there, and its backward hooks fence the prefetch stream against the
    TBE backward (FBGEMM PR #1893's dirty-cache and inconsistency cases)."""
    for fqn, module in ctx.modules.items():
        data = _dist_input(ctx, b, fqn)
        ctx.streams.hand_over([data, b.ctxs[fqn]], ctx.streams.dist, ctx.streams.prefetch)
        module.prefetch(data, forward_stream=ctx.streams.compute, ctx=b.ctxs[fqn])


def zero_grad(ctx: "StepContext", b: "InFlight") -> None:
    ctx.optimizer.zero_grad()


def forward(ctx: "StepContext", b: "InFlight") -> None:
    """``model(batch)`` -> ``(loss, output)``, TorchRec's contract."""
    ctx.pipeline.before_forward(b.device)
    ctx.current = b
    try:
        result = ctx.model(b.device)
    finally:
        ctx.current = None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise PipelineError(
            f"{ctx.pipeline.name}: model(batch) returned {type(result).__name__}"
            f"{f' of length {len(result)}' if isinstance(result, (tuple, list)) else ''}; in training a pipelined "
            "model returns (loss, output), as TorchRec's pipelines require (docs/models.md)"
        )
    loss, output = result
    _check_consumed(ctx, b)
    if b.zero_loss:  # a padding batch of a batch type without as_padding(): train nothing
        loss = loss * 0.0
    b.loss = loss
    b.loss_value = loss.detach()
    b.output = output


def forward_eval(ctx: "StepContext", b: "InFlight") -> None:
    """``model(batch)`` under ``torch.no_grad()`` (the caller set the model's eval mode):
    all the model returns is the batch's output, whatever its form (an evaluation reads
    its logits and labels, recpipe.pipelines.evaluation); no loss is kept for a backward."""
    ctx.current = b
    try:
        with torch.no_grad():
            b.output = ctx.model(b.device)
    finally:
        ctx.current = None
    _check_consumed(ctx, b)
    b.forwarded = True


def _check_consumed(ctx: "StepContext", b: "InFlight") -> None:
    if len(b.consumed) != len(ctx.modules):  # consumed holds only names of ctx.modules
        missing = set(ctx.modules) - b.consumed
        raise PipelineError(
            f"{ctx.pipeline.name}: forward did not call the sharded modules {sorted(missing)}; the pipeline ran their "
            "input all-to-all for this batch, so every sharded module must be called once per forward"
        )


def backward(ctx: "StepContext", b: "InFlight") -> None:
    """Dense grads and, inside FBGEMM's TBE backward, the embedding update."""
    assert b.loss is not None
    torch.sum(b.loss).backward()
    ctx.pipeline.after_backward(b.device, b.loss)
    b.loss = None  # frees the autograd graph


def optimizer(ctx: "StepContext", b: "InFlight") -> None:
    ctx.optimizer.step()
    ctx.pipeline.after_optimizer_step(b.device)


def sharded_forward(ctx: "StepContext", b: "InFlight", fqn: str, module: Any) -> Any:
    """What a sharded module's forward returns inside the pipeline.

    If the lookup ran ahead (``b.emb``), wait for its output all-to-all on the
    stream it ran on and hand the pooled embeddings to compute; otherwise take the
    distributed input and run ``compute_and_output_dist`` on the compute stream.
    """
    compute = ctx.streams.compute
    if fqn in b.emb_ready:  # waited by output_dist_wait
        pooled = b.emb_ready.pop(fqn)
        ctx.streams.hand_over(pooled, ctx.step_stream(b, "output_dist_wait"), compute)
        return pooled
    if fqn in b.emb:
        src = ctx.step_stream(b, "lookup")
        with use_stream(src, ctx.stream):
            pooled = b.emb.pop(fqn).wait()
        # Nothing to do when the lookup ran on compute (semi_sync, emb_lookup_stream=current).
        ctx.streams.hand_over(pooled, src, compute)
        return pooled
    data = _dist_input(ctx, b, fqn)
    ctx.streams.hand_over([data, b.ctxs[fqn]], ctx.streams.dist, compute)
    del b.dist_in[fqn]
    return grouped(module.compute_and_output_dist(b.ctxs[fqn], data))


def dense_params(optimizer: Any) -> list[torch.Tensor]:
    """The parameters whose gradient the dense optimizer applies (not the fused
    embedding optimizer's sharded tables, which TBE backward updates in place)."""
    return [p for g in optimizer.param_groups for p in g["params"] if not compat_torch.is_sharded_tensor(p)]


def detach_pooled(b: "InFlight", pooled: Any) -> Any:
    """Cut autograd at a sharded module's output (semi_sync's split backward): dense
    backward stops at leaves; ``backward_emb`` continues from the originals.
    ``pooled`` is a KeyedTensor (EmbeddingBagCollection and its feature-processed
    variant) or a dict of JaggedTensors (EmbeddingCollection: one per feature)."""

    def leaf(values: torch.Tensor) -> torch.Tensor:
        cut = values.detach().requires_grad_()
        b.detached.append((values, cut))
        return cut

    if isinstance(pooled, GroupedKeyedTensor) and pooled.grouped():  # a leaf per group: no concatenation
        return GroupedKeyedTensor(pooled.keys(), pooled.length_per_key(), [leaf(g) for g in pooled.groups()],
                                  pooled.keys_per_group())
    if isinstance(pooled, KeyedTensor):
        return KeyedTensor(
            keys=pooled.keys(), length_per_key=pooled.length_per_key(), values=leaf(pooled.values()), key_dim=pooled.key_dim()
        )
    if isinstance(pooled, dict) and all(isinstance(v, JaggedTensor) for v in pooled.values()):
        return {
            key: JaggedTensor(values=leaf(jt.values()), lengths=jt.lengths(), weights=jt.weights_or_none())
            for key, jt in pooled.items()
        }
    raise PipelineError(
        f"semi_sync cannot split backward at a sharded module output of type {type(pooled).__name__}; it supports "
        "KeyedTensor (EmbeddingBagCollection) and dict of JaggedTensor (EmbeddingCollection) outputs"
    )


STEPS: dict[str, Callable[["StepContext", "InFlight"], None]] = {
    "h2d": h2d,
    "input_dist": input_dist,
    "input_dist_wait": input_dist_wait,
    "lookup": lookup,
    "prefetch": prefetch,
    "output_dist_wait": output_dist_wait,
    "zero_grad": zero_grad,
    "forward": forward,
    "forward_eval": forward_eval,
    "backward": backward,
    "optimizer": optimizer,
}
