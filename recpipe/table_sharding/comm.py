"""The embeddings on the wire: ``sharding.comm_precision`` as torchrec's quantized-comm
codecs, or as recpipe's :class:`CastCodec` where the TBEs write the wire precision themselves."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from recpipe.config import ShardingConfig

# torch, torchrec and FBGEMM are imported by the functions that use them: the planner imports
# this module, and `recpipe plan` loads none of them.

__all__ = ["CastCodec", "qcomm_codecs_registry", "tbe_output_precision"]


def tbe_output_precision(sharding: "ShardingConfig", world_size: int, device_type: str = "cuda") -> str | None:
    """The precision the TBEs write their pooled outputs in, or None (fp32).

    When ``sharding.comm_precision`` sends both directions in the same half precision
    over several ranks, the TBEs write their outputs in it (FBGEMM ``output_dtype``)
    and :class:`CastCodec` replaces torchrec's codecs: nothing is encoded before the
    all-to-all (the TBE's output is what travels), the received values are decoded to
    fp32 for the model, the gradient is encoded once and handed to the TBE backward in
    the half precision (FBGEMM accumulates it in fp32). Two conversions a step instead
    of torchrec's four, and the TBEs write half the bytes. On one rank torchrec's
    all-to-alls return their input without decoding, so the outputs stay fp32 there;
    so do they with a data_parallel table anywhere: the TBE setting reaches its lookup
    too, whose output goes to the model without an all-to-all (torchrec's codecs then).
    On CPU FBGEMM writes fp16 only, as torchrec's codecs send bf16 as fp16 there."""
    comm = sharding.comm_precision
    if world_size <= 1 or comm.forward != comm.backward or comm.forward == "fp32":
        return None
    if "data_parallel" in {sharding.default.type, *(t.type for t in sharding.tables.values())}:
        return None
    return "fp16" if device_type != "cuda" else comm.forward


class CastCodec:
    """A torchrec ``QuantizedCommCodec`` that only casts: values travel as ``wire``;
    ``decode`` casts them to ``decoded`` (None: leaves them as they came)."""

    def __init__(self, wire: "torch.dtype", decoded: "torch.dtype | None") -> None:
        self.wire, self.decoded = wire, decoded

    def __repr__(self) -> str:
        return f"CastCodec(wire={self.wire}, decoded={self.decoded})"

    def encode(self, input_tensor: "torch.Tensor", ctx: object = None) -> "torch.Tensor":
        return input_tensor if input_tensor.dtype == self.wire else input_tensor.to(self.wire)

    def decode(self, input_grad: "torch.Tensor", ctx: object = None) -> "torch.Tensor":
        if self.decoded is None or input_grad.dtype == self.decoded:
            return input_grad
        return input_grad.to(self.decoded)

    @property
    def quantized_dtype(self) -> "torch.dtype":
        return self.wire

    def calc_quantized_size(self, input_len: int, ctx: object = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(self, input_tensor: "torch.Tensor", dim_per_rank: list[int], my_rank: int,
                    qcomm_ctx: object) -> tuple[int, int]:
        return (input_tensor.shape[1] if input_tensor.dim() > 1 else input_tensor.shape[0]), 0


def qcomm_codecs_registry(sharding: "ShardingConfig", device_type: str = "cuda", world_size: int = 1) -> dict | None:
    """The quantized-comm codecs for ``sharding.comm_precision`` (pooled and sequence
    all-to-alls, reduce-scatter), or None when both directions are fp32: recpipe's
    :class:`CastCodec` pair where the TBEs write the wire precision themselves
    (:func:`tbe_output_precision`), else torchrec's codecs. On CPU torchrec replaces
    bf16 by fp16 (Gloo); ``recpipe.table_sharding.precision.precision_warnings`` says so."""
    comm = sharding.comm_precision
    if comm.forward == "fp32" and comm.backward == "fp32":
        return None
    import torch
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
    from torchrec.distributed.types import CommOp, QuantizedCommCodecs

    output = tbe_output_precision(sharding, world_size, device_type)
    if output is not None:
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[output]
        pair = lambda: QuantizedCommCodecs(forward=CastCodec(wire, torch.float32), backward=CastCodec(wire, None))  # noqa: E731
        ops = (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
               CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
        return {op.name: pair() for op in ops}

    config = QCommsConfig(forward_precision=CommType(comm.forward), backward_precision=CommType(comm.backward))
    # torchrec logs its bf16 -> fp16 fallback on CPU to the root logger once per comm
    # op and sharder; recpipe's launcher warns once instead (precision_warnings).
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        return get_qcomm_codecs_registry(config, device=torch.device(device_type))
    finally:
        root.setLevel(level)
