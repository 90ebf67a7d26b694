"""Where each sharded module's input comes from: found in the batch, or computed from it.

A pipeline starts the input all-to-all of batch i+1 before the model's forward of
batch i runs, so it must know, without running the model, which KeyedJaggedTensor
each sharded module will be called with. TorchRec finds out by FX-tracing the model;
recpipe instead watches one real forward. The first batch of a pipeline's life is
trained with every sharded module running its own forward (numerically the plain
loop), and the interceptor looks up the KeyedJaggedTensor each module receives in
the batch *by identity*: a breadth-first walk over attributes, dataclass fields,
dict values and list/tuple items, at most ``MAX_DEPTH`` levels deep. The path it
finds (``batch.features["user"]``) is kept per module and checked again on every
later step, so a model that changes where it reads its input gets an error, not a
silent fallback.

A module whose KeyedJaggedTensor is built inside the model's forward (concat,
permute, a feature transform) has no path. For it the user passes a function
``inputs={"sparse.ebc": fn}``: the pipeline calls ``fn(device_batch)`` on the
input-dist stream, ahead of forward, and hands the module what ``fn`` returned.
On the first batch ``fn``'s result is compared, value for value, with what the
model really passes the module; a mismatch is an error naming the field.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

MAX_DEPTH = 4  # attribute / key / index steps from the batch to a KeyedJaggedTensor

# One step from an object to a part of it: ("attr", name), ("key", key) or ("index", i).
Accessor = tuple[str, Any]


@dataclass(frozen=True)
class BatchPath:
    """A KeyedJaggedTensor's place in the batch, e.g. ``batch.features["user"]``."""

    steps: tuple[Accessor, ...]

    def get(self, batch: Any) -> Any:
        obj = batch
        for kind, key in self.steps:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
        return obj

    def __str__(self) -> str:
        out = "batch"
        for kind, key in self.steps:
            out += f".{key}" if kind == "attr" else f"[{key!r}]"
        return out


@dataclass(frozen=True)
class ComputedInput:
    """A module input computed from the device batch by a user function."""

    fn: Callable[[Any], KeyedJaggedTensor]

    def get(self, batch: Any) -> KeyedJaggedTensor:
        return self.fn(batch)

    def __str__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"{getattr(self.fn, '__module__', '?')}.{name}(batch)"


InputSource = Union[BatchPath, ComputedInput]


def _children(obj: Any) -> list[tuple[Accessor, Any]]:
    """The parts of ``obj`` the walk descends into (none for tensors and KJTs)."""
    if isinstance(obj, (torch.Tensor, KeyedJaggedTensor, str, bytes, int, float, bool)) or obj is None:
        return []
    if isinstance(obj, Mapping):
        return [(("key", k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(("index", i), v) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(("attr", f.name), getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
        return []
    return [(("attr", k), v) for k, v in vars(obj).items()]


def find_path(batch: Any, target: Any, max_depth: int = MAX_DEPTH) -> BatchPath | None:
    """The shortest path from ``batch`` to the object ``target`` (identity), or None."""
    seen = {id(batch)}
    queue: deque[tuple[Any, tuple[Accessor, ...]]] = deque([(batch, ())])
    while queue:
        obj, path = queue.popleft()
        if obj is target:
            return BatchPath(path)
        if len(path) == max_depth:
            continue
        for step, child in _children(obj):
            if id(child) not in seen:
                seen.add(id(child))
                queue.append((child, (*path, step)))
    return None


def kjts_in(batch: Any, max_depth: int = MAX_DEPTH) -> list[str]:
    """Paths of every KeyedJaggedTensor in ``batch`` (for error messages)."""
    found, seen = [], {id(batch)}
    queue: deque[tuple[Any, tuple[Accessor, ...]]] = deque([(batch, ())])
    while queue:
        obj, path = queue.popleft()
        if isinstance(obj, KeyedJaggedTensor):
            found.append(f"{BatchPath(path)} (keys {obj.keys()})")
        if len(path) < max_depth:
            for step, child in _children(obj):
                if id(child) not in seen:
                    seen.add(id(child))
                    queue.append((child, (*path, step)))
    return found


def kjt_difference(expected: KeyedJaggedTensor, got: KeyedJaggedTensor) -> str | None:
    """The first field in which two KeyedJaggedTensors differ, or None if equal.
    Host sync (compares values); used once, on the discovery batch."""
    if not isinstance(expected, KeyedJaggedTensor):
        return f"the function returned {type(expected).__name__}, not a KeyedJaggedTensor"
    if expected.keys() != got.keys():
        return f"keys {expected.keys()} vs {got.keys()}"
    for field in ("lengths", "values"):
        a, b = getattr(expected, field)(), getattr(got, field)()
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b.to(a.device)):
            return f"{field} differ (shapes {tuple(a.shape)} vs {tuple(b.shape)}, dtypes {a.dtype} vs {b.dtype})"
    wa, wb = expected.weights_or_none(), got.weights_or_none()
    if (wa is None) != (wb is None):
        return f"weights: {'none' if wa is None else 'present'} vs {'none' if wb is None else 'present'}"
    if wa is not None and not torch.equal(wa, wb.to(wa.device)):
        return "weights differ"
    return None
