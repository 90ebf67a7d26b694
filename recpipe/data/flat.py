"""A :class:`Batch` as a list of tensors plus a small picklable spec, and back.

Used by the process producers (``recpipe.data.processes``): the tensors travel
through shared memory, the spec through a pipe. Every field of ``Batch`` is kept,
and every constructor field of the ``KeyedJaggedTensor`` (``keys``, ``values``,
``weights``, ``lengths``, ``offsets``, ``stride``, the per-key caches, the
variable-batch ``stride_per_key_per_rank`` and ``inverse_indices``), read from the
attribute of the same name with a leading underscore, as torchrec's constructor
stores them (torchrec 1.6 and 1.8 alike). torchrec's own pytree flattening of a KJT
keeps only the keys and the tensors (it drops ``stride`` and the caches), so it is
not used. ``jt_dict`` is left out: a cache of per-key views, rebuilt on demand.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterator

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.compat import torchrec as compat_torchrec
from recpipe.data.batch import Batch

__all__ = ["KJT_FIELDS", "flatten_batch", "unflatten_batch"]

KJT_FIELDS = tuple(p for p in inspect.signature(KeyedJaggedTensor.__init__).parameters if p not in ("self", "jt_dict"))
_BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(Batch))
# Spec entries: a tensor (the next one of the list), a KJT, a tuple, or a plain value.
_TENSOR, _KJT, _TUPLE, _PLAIN = range(4)


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (_TENSOR,)
    if isinstance(value, KeyedJaggedTensor):
        return (_KJT, tuple(_encode(v, tensors) for v in compat_torchrec.kjt_fields(value, KJT_FIELDS)))
    if type(value) is tuple:  # inverse_indices: (keys, tensor)
        return (_TUPLE, tuple(_encode(v, tensors) for v in value))
    return (_PLAIN, value)


def _decode(spec: Any, tensors: Iterator[torch.Tensor]) -> Any:
    kind = spec[0]
    if kind == _TENSOR:
        return next(tensors)
    if kind == _KJT:
        return KeyedJaggedTensor(**{name: _decode(s, tensors) for name, s in zip(KJT_FIELDS, spec[1])})
    if kind == _TUPLE:
        return tuple(_decode(s, tensors) for s in spec[1])
    return spec[1]


def flatten_batch(batch: Batch) -> tuple[list[torch.Tensor], tuple]:
    """``batch``'s tensors in a fixed order, and the spec that rebuilds it from them."""
    tensors: list[torch.Tensor] = []
    spec = tuple(_encode(getattr(batch, name), tensors) for name in _BATCH_FIELDS)
    return tensors, spec


def unflatten_batch(spec: tuple, tensors: list[torch.Tensor]) -> Batch:
    """The batch that ``flatten_batch`` described, built on ``tensors`` (not copied)."""
    it = iter(tensors)
    batch = Batch(**{name: _decode(s, it) for name, s in zip(_BATCH_FIELDS, spec)})
    assert next(it, None) is None, "more tensors than the spec names"
    return batch
