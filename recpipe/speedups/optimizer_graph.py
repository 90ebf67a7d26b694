"""The dense optimizer's step as a CUDA graph (``pipeline.cuda_graphs`` with
``pipeline.cuda_graphs.optimizer``, the default).

Why: at 8192 samples per GPU a step of a Criteo-sized DLRM is bound by the host, and
``torch.optim.Adagrad``'s foreach step spends host time launching a few kernels per
tensor group (docs/pipelines.md, "CUDA graphs of the dense part"). Replayed, it
costs one copy of the gradients, one graph launch and, for Adagrad, one host-side add
on the step counts.

What is replayed: every ``torch.optim`` optimizer inside the pipeline's optimizer
(torchrec's ``CombinedOptimizer`` / ``KeyedOptimizerWrapper`` / ``OptimizerWrapper``,
or a plain torch optimizer). The fused embedding optimizer is left alone: the TBE
backward already applied it, and its ``step()`` only writes the learning rate into a
host tensor of FBGEMM.

Exactness: a replay launches the kernels the eager step launched while it was captured,
with the same scalars, on the same parameters and state tensors, so parameters and
state are bit-identical to the eager step's. What the graph cannot do is what the step
does on the host, so only optimizers whose host part is known are replayed:

* ``torch.optim.SGD`` (momentum or not): nothing on the host.
* ``torch.optim.Adagrad`` with ``lr_decay == 0``: its per-parameter ``step`` is a CPU
  tensor, +1 per step; the capture runs that add once, and after every later replay it
  is done here the way Adagrad does it (foreach add of 1.0), so ``state_dict()`` and
  checkpoints see the eager values. With ``lr_decay != 0`` the learning rate
  ``lr / (1 + (step - 1) * lr_decay)`` is computed on the host each step, so it runs
  eagerly.
* Anything else runs eagerly, with one warning naming the optimizer and the reason:
  Adam and its kin compute bias corrections on the host from the step count (their
  ``capturable=True`` computes them on the GPU and rounds differently from the eager
  step), ``fused=True`` (except SGD's), tensor-valued hyperparameters other than ``lr``.

A scheduled learning rate (``optimizer.dense.schedule``) is a 0-dim tensor on the
parameters' device (``recpipe.sharding.build.dense_optimizer``) that the trainer fills
before each step: the captured kernels read it on the device, so every replay uses the
rate of its step with no new capture. Only the paths that read a tensor ``lr`` on the
device are replayed with one: fused SGD (foreach SGD passes ``alpha=-lr``, which torch
reads on the host) and foreach Adagrad (``-lr / 1`` and a multiplication, device work;
its single-tensor step calls ``.item()``). A float ``lr`` is a binding, as below.

Lifetime: a ``GraphedOptimizerStep`` is the torch optimizer's instance ``step`` while
applied (``recpipe.speedups.cuda_graphs.apply_cuda_graphs``). Its first ``WARMUP_CALLS``
calls run eagerly (state created, kernels loaded); the next one with the same bindings
captures (``torch.cuda.graph``, on a side stream; the device is synchronized once) and
replays. Every call first compares what the graph baked in, its bindings: every
``param_groups`` value (lr, eps, weight_decay, ...), which parameters have a gradient,
and the identity and address of each of them and of their state tensors. Any change (an
lr set by hand or by a scheduler, ``load_state_dict`` replacing state tensors, a
parameter without a gradient this step) makes that call eager, and a new graph is
captured once the bindings have held for ``WARMUP_CALLS`` calls; after ``MAX_CHANGES``
changes the step stays eager, with one warning. A closure, step hooks and
GradScaler's ``grad_scale``/``found_inf`` make a call eager too. torchrec's
``load_state_dict`` copies into the state tensors in place, so a checkpoint resume into
a live graph needs no new capture.

Gradients: the graph reads its own gradient buffers; before each replay one
``_foreach_copy_`` copies the ``.grad`` tensors into them, so the gradients may live
anywhere (DDP's bucket views, semi_sync's stashed clones). Memory: those buffers and the
graph's pool for the step's temporaries, about twice the dense parameters.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torchrec.optim.fused import FusedOptimizer
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper

from recpipe.compat import torch as compat_torch
from recpipe.compat import torchrec as compat_torchrec
from recpipe.errors import PipelineError, job_warning

WARMUP_CALLS = 2  # eager calls with the same bindings before a capture
MAX_CHANGES = 8  # binding changes after which the step stays eager

# The torch optimizers replayed, and the state entries their step updates on the host
# (CPU tensors, +1 per step for each parameter with a gradient).
HOST_STATE: dict[type, tuple[str, ...]] = {torch.optim.SGD: (), torch.optim.Adagrad: ("step",)}

Capture = Callable[[Callable[[], None]], Callable[[], None]]


def capture_with_torch(step: Callable[[], None]) -> Callable[[], None]:
    """Capture ``step()`` into a CUDA graph (``recpipe.compat.torch.graph_capture``: other
    threads may call CUDA meanwhile); returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with compat_torch.graph_capture(graph):
        step()
    return graph.replay


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers inside torchrec's optimizer wrappers, in step
    order; fused embedding optimizers are left out."""
    if isinstance(optimizer, CombinedOptimizer):
        return [inner for _, opt in optimizer.optimizers for inner in torch_optimizers(opt)]
    if isinstance(optimizer, (KeyedOptimizerWrapper, OptimizerWrapper)):
        return torch_optimizers(compat_torchrec.wrapped_optimizer(optimizer))
    if isinstance(optimizer, FusedOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
        return []
    return [optimizer]


def fused_optimizers(optimizer: Any) -> list[Any]:
    """torchrec's fused (in-backward) embedding optimizers inside ``optimizer``, in step order."""
    if isinstance(optimizer, CombinedOptimizer):
        return [inner for _, opt in optimizer.optimizers for inner in fused_optimizers(opt)]
    return [optimizer] if isinstance(optimizer, FusedOptimizer) else []


def unsupported(opt: torch.optim.Optimizer) -> str | None:
    """Why replaying ``opt.step()`` could differ from running it, or None."""
    kind = type(opt)
    if kind not in HOST_STATE:
        if "betas" in opt.defaults:
            return (f"{kind.__name__} computes its bias corrections on the host from the step count (capturable=True "
                    "would move them to the GPU, rounding differently from the eager step)")
        return f"recpipe replays torch.optim.SGD and torch.optim.Adagrad steps, not {kind.__module__}.{kind.__name__}"
    for i, group in enumerate(opt.param_groups):
        tensors = sorted(k for k, v in group.items() if k not in ("params", "lr") and isinstance(v, torch.Tensor))
        if tensors:
            return f"param_groups[{i}] {tensors} are tensors (read on the host when captured)"
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            devices = {p.device for p in group["params"]}
            if lr.numel() != 1 or lr.requires_grad or devices != {lr.device}:
                return (f"param_groups[{i}] lr is a tensor on {lr.device} of {lr.numel()} elements (a 0-dim tensor on "
                        f"the parameters' device, {sorted(map(str, devices))}, is read on the device)")
            if kind is torch.optim.SGD and not group.get("fused"):
                return f"param_groups[{i}] lr is a tensor, which foreach SGD reads on the host (alpha=-lr); use fused=True"
            if kind is torch.optim.Adagrad and not group.get("foreach"):
                return f"param_groups[{i}] lr is a tensor, which Adagrad's single-tensor step reads on the host; use foreach=True"
        if group.get("fused") and kind is not torch.optim.SGD:
            return f"param_groups[{i}] has fused=True"
        if group.get("differentiable"):
            return f"param_groups[{i}] has differentiable=True"
        if kind is torch.optim.Adagrad and group["lr_decay"] != 0:
            return (f"param_groups[{i}] has lr_decay={group['lr_decay']}: the decayed learning rate is computed on "
                    "the host every step")
    return None


class GraphedOptimizerStep:
    """Stands in for one torch optimizer's ``step`` while the pipeline is attached."""

    def __init__(self, optimizer: torch.optim.Optimizer, capture: Capture = capture_with_torch) -> None:
        self.optimizer = optimizer
        self._capture = capture
        self._replay: Callable[[], None] | None = None
        self._bound: tuple | None = None  # the bindings the graph baked in
        self._keep: list[torch.Tensor] = []  # the bound tensors, kept alive so that their ids stay unique
        self._static_grads: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []  # host state the replay does not update (Adagrad's step)
        self._one = torch.tensor(1.0)
        self._seen: tuple | None = None  # the bindings of the last call
        self._held = 0  # eager calls in a row with the bindings in _seen
        self.disabled: str | None = None  # why every call runs eagerly
        self.replays = self.eager_calls = self.captures = self.changes = 0

    def __repr__(self) -> str:
        kind = type(self.optimizer).__name__
        state = f"eager: {self.disabled}" if self.disabled else "captured" if self._replay else "not captured"
        return (f"GraphedOptimizerStep({kind}, {state}; {self.captures} captures, {self.replays} replays, "
                f"{self.eager_calls} eager calls)")

    @property
    def captured(self) -> bool:
        """Whether the step is captured, or will never be (every call runs eagerly)."""
        return self._replay is not None or self.disabled is not None

    def __call__(self, closure: Callable[[], Any] | None = None) -> Any:
        opt = self.optimizer
        if (closure is not None or self.disabled or compat_torch.has_optimizer_step_hooks(opt)
                or getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None):
            return self._eager(closure)
        with_grad = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in with_grad]
        if not grads or any(g.is_sparse for g in grads):
            return self._eager(None)
        bindings, tensors = self._bindings(with_grad)
        if self._replay is not None and bindings == self._bound:
            compat_torch.foreach_copy_(self._static_grads, grads)
            self._replay()
            if self._host:  # what Adagrad's step does on the host: step += 1 (float, as it adds 1.0)
                compat_torch.foreach_add_(self._host, self._one, alpha=1.0)
            self.replays += 1
            return None
        if bindings != self._seen:
            self._drop()
            if self._seen is not None:
                self.changes += 1
            self._seen, self._held = bindings, 0
            if self.changes > MAX_CHANGES:
                self._disable(f"its hyperparameters, parameters or state changed {self.changes} times (an lr "
                              "scheduler?)")
                return self._eager(None)
        # Held for WARMUP_CALLS eager steps: the state exists and an eager step no longer
        # creates any (SGD's momentum buffers appear at its first step), so the capture
        # records the steady-state step.
        if self._held < WARMUP_CALLS:
            self._held += 1
            return self._eager(None)
        reason = unsupported(opt)
        if reason:
            self._disable(reason)
            return self._eager(None)
        self._capture_and_replay(with_grad, bindings, tensors)
        return None

    def _bindings(self, with_grad: list[torch.Tensor]) -> tuple[tuple, list[torch.Tensor]]:
        """What a graph bakes in, and the tensors among it: every param_groups value, and
        each parameter with a gradient and its state tensors by id and address."""
        opt = self.optimizer
        # A tensor hyperparameter (a scheduled lr) is bound by identity and address: the graph
        # reads its memory, whatever value it holds.
        hyper = tuple(tuple((k, ("tensor", id(v), v.data_ptr()) if isinstance(v, torch.Tensor) else v)
                            for k, v in group.items() if k != "params") for group in opt.param_groups)
        tensors = [v for group in opt.param_groups for k, v in group.items()
                   if k != "params" and isinstance(v, torch.Tensor)]
        for p in with_grad:
            tensors.append(p)
            tensors.extend(v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
        return (hyper, tuple(map(id, tensors)), tuple(map(torch.Tensor.data_ptr, tensors))), tensors

    def _eager(self, closure: Callable[[], Any] | None) -> Any:
        self.eager_calls += 1
        return type(self.optimizer).step(self.optimizer, closure)

    def _drop(self) -> None:
        self._replay, self._bound, self._keep, self._static_grads, self._host = None, None, [], [], []

    def _disable(self, reason: str) -> None:
        self._drop()
        self.disabled = reason
        kind = type(self.optimizer)
        warnings.warn(f"pipeline.cuda_graphs: the dense optimizer's step ({kind.__module__}.{kind.__name__}) runs "
                      f"eagerly: {reason}", stacklevel=3)

    def _capture_and_replay(self, with_grad: list[torch.Tensor], bindings: tuple, tensors: list[torch.Tensor]) -> None:
        """Capture the step on this call's gradients, then replay it: this call's update.
        The capture runs the step's host part (Adagrad's step counts +1) but none of its
        kernels."""
        opt = self.optimizer
        static = [p.grad.detach().clone() for p in with_grad]
        host = [opt.state[p][key] for p in with_grad for key in HOST_STATE[type(opt)]]
        before = [t.clone() for t in host]

        def step() -> None:
            real = [p.grad for p in with_grad]
            for p, g in zip(with_grad, static):
                p.grad = g
            try:
                type(opt).step(opt)
            finally:
                for p, g in zip(with_grad, real):
                    p.grad = g

        try:
            replay = self._capture(step)
        except Exception as err:  # any failure of capture: name the optimizer and the way out
            for t, b in zip(host, before):
                t.copy_(b)
            raise PipelineError(
                f"pipeline.cuda_graphs: cannot capture the dense optimizer's step ({type(opt).__name__}: "
                f"{type(err).__name__}: {err}); set pipeline.cuda_graphs.optimizer=false to run it eagerly"
            ) from err
        if not all(torch.equal(t, b + 1) for t, b in zip(host, before)):
            for t, b in zip(host, before):
                t.copy_(b)
            self._disable(f"its step counts did not advance on the host while captured (torch {torch.__version__} "
                          "keeps them elsewhere)")
            self._eager(None)
            return
        self.captures += 1
        self._replay, self._bound, self._keep, self._static_grads, self._host = replay, bindings, tensors, static, host
        self._replay()
        self.replays += 1


def graph_steps(optimizer: Any, device: torch.device) -> list[GraphedOptimizerStep]:
    """A ``GraphedOptimizerStep`` for every torch optimizer inside ``optimizer`` whose
    step can be replayed exactly on ``device`` (CUDA); the others are named in one
    warning each."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for opt in torch_optimizers(optimizer):
        kind = type(opt)
        reason = unsupported(opt)
        devices = {p.device for group in opt.param_groups for p in group["params"]}
        if reason is None and devices != {device}:  # a graph runs on one device, the current one
            reason = f"its parameters are on {sorted(map(str, devices))}, not all on {device}"
        if reason is None and "step" in vars(opt):
            reason = f"its step is already replaced ({vars(opt)['step']!r}: an lr scheduler, or another pipeline?)"
        if reason:
            job_warning(f"pipeline.cuda_graphs: the dense optimizer's step ({kind.__module__}.{kind.__name__}) runs "
                        f"eagerly: {reason}; set pipeline.cuda_graphs.optimizer=false to silence this", stacklevel=3)
            continue
        out.append(GraphedOptimizerStep(opt))
    return out


def install(steps: list[GraphedOptimizerStep]) -> None:
    for graphed in steps:
        own = vars(graphed.optimizer).get("step")
        if own is not None and own is not graphed:
            raise PipelineError(f"pipeline.cuda_graphs: the dense optimizer's step was already replaced ({own!r}); "
                                "is another graphed step applied to this optimizer?")
        graphed.optimizer.step = graphed


def remove(steps: list[GraphedOptimizerStep]) -> None:
    for graphed in steps:
        if vars(graphed.optimizer).get("step") is graphed:
            del graphed.optimizer.step
