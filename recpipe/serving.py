"""A servable program of the unsharded model: ``recpipe export --format program``.

:func:`export_program` writes a ``torch.export`` program (``torch.export.save``, a
``.pt2`` archive) of the unsharded built-in model (DLRM or DCNv2) with the exported
weights, whose inputs are plain tensors::

    dense_features  float32 [B, model.num_dense_features]
    values          int64   [N]      the ids of every feature, feature after feature
    lengths         int32   [F * B]  ids per (feature, sample), feature-major: lengths[f * B + b]

and whose output is the click probability, float32 [B] (the sigmoid of the model's
logit). ``values`` / ``lengths`` are a KeyedJaggedTensor's, in the model's feature
order (``cat_0`` ... for the built-in model); the batch size (1 to ``MAX_BATCH``) and
the id count are dynamic. The program loads with ``torch.export.load(path).module()``, without recpipe
or torchrec; with quantized tables it runs FBGEMM's inference kernels, so the process
imports ``fbgemm_gpu`` first (which registers them).

Tables (``tables``):

* ``fp32``: the trained weights; the program predicts bit for bit what the trained
  (sharded) model predicts (tests/test_export.py).
* ``fp16``: the weights in float16, looked up in float16 and cast to float32 where
  they meet the dense part (half the bytes).
* ``int8`` / ``int4``: TorchRec's quantized EmbeddingBagCollection
  (``torchrec.inference.modules.quantize_inference_model``: FBGEMM's
  ``IntNBitTableBatchedEmbeddingBagsCodegen``, row-wise with a float16 scale and bias
  per row, rows packed back to back: about 0.31 (int8) and 0.19 (int4) of the fp32
  tables' bytes at dimension 16). Its FBGEMM module holds ``fbgemm::AtomicCounter``
  objects, which ``torch.export`` traces with torchrec's fake classes
  (``torchrec.pt2.utils.register_fake_classes``). The program holds FBGEMM's one packed
  buffer of all the tables, not torchrec's per-table views of it.

A ``model.factory`` model is served through two methods of its own: ``serve(*tensors)``,
its prediction on plain tensors (it builds its KeyedJaggedTensors inside), and
``serving_inputs(batch_size) -> {name: tensor}``, example inputs of that form, in
``serve``'s order. Every dimension of every input is dynamic where the trace leaves it
free (``torch.export.Dim.AUTO``); the tables are converted as above in every torchrec
``EmbeddingBagCollection`` and ``EmbeddingCollection`` of the model (fp16: an
EmbeddingCollection's lookups come out float32 by torchrec's own cast; int8 / int4: TorchRec's
quantized EmbeddingCollection). A ``serve`` that torch.export cannot trace is a
:class:`~recpipe.errors.ConfigError` (exit 2) naming the model, the submodule and the line
it failed at, and torch.export's reason.

The program's metadata (inputs, feature order, tables, the checkpoint) is stored in the
archive as ``extra/recpipe.json`` (``torch.export.load(path, extra_files={"recpipe.json": ""})``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
import torchrec
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_symbols, is_concrete_int
from torchrec.inference.modules import quantize_inference_model
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.pt2.utils import register_fake_classes
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection
from torchrec.quant.embedding_modules import quant_prep_customize_row_alignment
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

import recpipe
from recpipe.compat import torch as compat_torch
from recpipe.config import ModelConfig, RecpipeConfig
from recpipe.errors import ConfigError
from recpipe.models import make_model
from recpipe.models.dlrm import RecModel, build_model, sparse_arch_forward
from recpipe.models.precision import precision_context

__all__ = ["ServingModule", "UserServing", "example_inputs", "export_program", "serving_module",
           "user_serving_module"]

_QUANT_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2}
MAX_BATCH = 1 << 20  # the largest batch the program's dynamic batch dimension admits


class ServingModule(nn.Module):
    """``(dense_features, values, lengths) -> click probability``: the built-in model's
    forward without the loss, on plain tensors (see the module docstring)."""

    def __init__(self, model: RecModel, feature_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.feature_names = list(feature_names)

    def forward(self, dense_features: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features = KeyedJaggedTensor(keys=self.feature_names, values=values, lengths=lengths)
        dlrm = self.model.model
        with precision_context(self.model):
            dense = dlrm.dense_arch(dense_features)
        sparse = sparse_arch_forward(dlrm.sparse_arch, features)
        with precision_context(self.model):
            logits = dlrm.over_arch(self.model.head.interact(dense, sparse)).squeeze(-1)
        return torch.sigmoid(logits.float())


def serving_module(cfg: RecpipeConfig, state: dict[str, torch.Tensor],
                   tables: Literal["fp32", "fp16", "int8", "int4"] = "fp32") -> nn.Module:
    """The unsharded model on CPU with ``state`` (the exported state dict), its tables as
    ``tables`` says, in eval mode, wrapped for serving (a ``model.factory`` model:
    :func:`user_serving_module`)."""
    if cfg.model.factory is not None:
        return user_serving_module(make_model(cfg), cfg.model.factory, state, tables)
    model = build_model(cfg.model, device=torch.device("cpu"), precision=cfg.train.precision)
    model.load_state_dict(state)
    model.eval()
    if tables == "fp16":
        model.model.sparse_arch.embedding_bag_collection.half()
    elif tables in _QUANT_DTYPES:
        _quantize(model.model, tables)
    return ServingModule(model, cfg.model.feature_names).eval()


class UserServing(nn.Module):
    """``(*inputs) -> model.serve(*inputs)``: a ``model.factory`` model's serving forward
    as the module torch.export traces."""

    def __init__(self, model: nn.Module, factory: str) -> None:
        super().__init__()
        self.model, self.factory = model, factory  # factory: the config's model.factory, for errors and metadata

    def name(self) -> str:
        return _model_name(self.factory, self.model)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model.serve(*inputs)


def _model_name(factory: str | None, model: nn.Module) -> str:
    return f"model.factory={factory!r} ({type(model).__module__}.{type(model).__qualname__})"


def user_serving_module(model: nn.Module, factory: str, state: dict[str, torch.Tensor],
                        tables: Literal["fp32", "fp16", "int8", "int4"] = "fp32") -> UserServing:
    """``model`` (as the ``model.factory`` named ``factory`` built it) on CPU with ``state``,
    its EmbeddingBagCollections' and EmbeddingCollections' tables as ``tables`` says, in eval
    mode, wrapped for serving."""
    missing = [m for m in ("serve", "serving_inputs") if not callable(getattr(model, m, None))]
    if missing:
        raise ConfigError(f"{_model_name(factory, model)} has no {' or '.join(missing)}: --format program traces "
                          "model.serve(*tensors) -> prediction on example inputs model.serving_inputs(batch_size) -> "
                          "{name: tensor} (docs/export.md, \"Your own model\")")
    model.load_state_dict(state, assign=True)  # the tables built on meta take the exported tensors
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ConfigError(f"{_model_name(factory, model)}: {on_meta[:5]} are on the meta device and not in its state "
                          "dict; build them on CPU in the factory (only the state dict's tensors are loaded)")
    model.eval()
    if tables == "fp16":
        for module in model.modules():
            if isinstance(module, EmbeddingBagCollection):
                module.half()
                module.register_forward_hook(_pooled_as_float)
            elif isinstance(module, EmbeddingCollection):  # its forward casts each lookup to float32
                module.half()
    elif tables in _QUANT_DTYPES:
        _quantize(model, tables)
    return UserServing(model, factory).eval()


def _pooled_as_float(module: nn.Module, inputs: Any, kt: Any) -> Any:
    """The float16 tables' pooled embeddings, cast to float32 where they meet the dense part."""
    return KeyedTensor(keys=kt.keys(), length_per_key=kt.length_per_key(), values=kt.values().float(),
                       key_dim=kt.key_dim())


def _quantize(model: nn.Module, tables: str) -> None:
    """Every EmbeddingBagCollection and EmbeddingCollection of ``model`` -> TorchRec's
    quantized one, in place."""
    # Rows packed back to back: FBGEMM's CPU kernels need no alignment (TorchRec's
    # default pads each row to 16 bytes for GPUs; the program runs on CPU).
    quant_prep_customize_row_alignment(model, [EmbeddingBagCollection, EmbeddingCollection], 1)
    quantize_inference_model(model, quantization_dtype=_QUANT_DTYPES[tables])
    for module in model.modules():
        if isinstance(module, QuantEmbeddingBagCollection):
            _drop_table_mirrors(module.embedding_bags)
        elif isinstance(module, QuantEmbeddingCollection):
            _drop_table_mirrors(module.embeddings)


def _drop_table_mirrors(tables: nn.ModuleDict) -> None:
    """Remove the per-table buffers of TorchRec's quantized EmbeddingBagCollection
    (``embedding_bags``) or EmbeddingCollection (``embeddings``).

    Their lookups read FBGEMM's packed buffer (``tbes.0.weights_host``: every table's rows,
    one after the other); ``<tables>.<table>.weight`` are views into that buffer, kept
    only so that the module's ``state_dict`` names each table, and the program never
    reads them. ``torch.export.save`` writes buffers and constants apart, so the views
    would store the packed tables a second time, and int4's views (TorchRec's
    ``UInt4Tensor``) are pickled one by one, each with the whole buffer."""
    for table in tables.values():
        for name, _ in list(table.named_buffers(recurse=False)):
            delattr(table, name)


def example_inputs(m: ModelConfig, batch_size: int = 3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs of the program's form: ``batch_size`` samples, 1 or 2 ids per feature."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3, (m.num_sparse_features * batch_size,), generator=g, dtype=torch.int32)
    per_feature = lengths.view(m.num_sparse_features, batch_size).sum(1).tolist()
    values = torch.cat([torch.randint(0, rows, (n,), generator=g) for rows, n in zip(m.num_embeddings_per_feature,
                                                                                        per_feature)])
    return torch.randn(batch_size, m.num_dense_features, generator=g), values, lengths


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Without what torch and torchrec log about their own tracing: torch.fx's
    ``is_fx_tracing`` notice, torchrec's note that a KJT's ``to_dict`` is traced (on the
    root logger), neither of which a user can act on, and the partial graph torch logs
    when a trace fails (the error that follows names the reason and the line)."""
    loggers = [compat_torch.fx_trace_logger(), logging.getLogger(), logging.getLogger("torch.fx.experimental.symbolic_shapes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _drop_unused_symbols(program: torch.export.ExportedProgram) -> None:
    """Forget the range of every symbol that no node of ``program``'s graph uses.

    TorchRec's quantized EmbeddingBagCollection splits its features by per-feature offsets
    it computes as data-dependent sizes (``.tolist()``) and then does not use: the graph
    loses them, their ranges stay, and loading the program logs "Symbol uN did not appear
    in the graph" for each."""
    used = set()
    for node in program.graph.nodes:
        val = node.meta.get("val")
        for value in val if isinstance(val, (list, tuple)) else [val]:
            if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
                used |= set(free_symbols(value))
    ranges = program.range_constraints  # the program's own mapping: it has no setter
    for expr in [expr for expr in ranges if not expr.free_symbols <= used]:
        del ranges[expr]


def _user_trace_spec(module: UserServing) -> tuple[list[str], tuple[torch.Tensor, ...], dict]:
    """A ``model.factory`` model's example inputs (``serving_inputs``) and their dynamic
    shapes: every dimension is ``Dim.AUTO``, dynamic unless the trace fixes it (a weight's
    size) or ties it to another input's."""
    with _user_errors(module, "serving_inputs"):
        named = module.model.serving_inputs(3)
    if not (isinstance(named, dict) and named and all(isinstance(t, torch.Tensor) for t in named.values())):
        raise ConfigError(f"{module.name()}: serving_inputs(3) returned {type(named).__name__}; it "
                          "must return {name: tensor}, in the order of serve's arguments")
    inputs = tuple(named.values())
    auto = torch.export.Dim.AUTO
    return list(named), inputs, {"inputs": tuple({d: auto for d in range(t.dim())} for t in inputs)}


def _user_meta(module: UserServing, program: torch.export.ExportedProgram,
               names: list[str]) -> dict[str, Any]:
    """The program's inputs (name: dtype, shape; a dynamic size by its symbol) and output."""
    def spec(node: torch.fx.Node) -> list:
        val = node.meta["val"]
        return [str(val.dtype).removeprefix("torch."), [int(d) if is_concrete_int(d) else str(d) for d in val.shape]]

    nodes = program.graph.nodes
    user = set(program.graph_signature.user_inputs)
    user_inputs = [n for n in nodes if n.op == "placeholder" and n.name in user]
    output = [n for n in nodes if n.op == "output"][0].args[0]
    outputs = [spec(o) for o in output if isinstance(o, torch.fx.Node)]
    return {"model": f"{type(module.model).__module__}.{type(module.model).__qualname__}",
            "factory": module.factory,
            "inputs": {name: spec(node) for name, node in zip(names, user_inputs)},
            "output": outputs[0] if len(outputs) == 1 else outputs}


@contextlib.contextmanager
def _user_errors(module: nn.Module, call: str, tracing: bool = False) -> Iterator[None]:
    """A ``model.factory`` model's ``call`` failing to run or to be traced -> ConfigError (exit 2)
    naming the model, the submodule and the line of the user's code, and the reason.
    What torch.export prints on a failed trace (the partial graph, on stderr) is left
    out: the error names the line."""
    if not isinstance(module, UserServing):
        yield
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except ConfigError:
        raise
    except Exception as err:  # the user's code, or torch.export on it
        where = _where(module.model, err)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        what = "torch.export cannot trace" if tracing else f"{type(err).__name__} in"
        raise ConfigError(
            f"{module.name()}: {what} its {call}{where}: {reason}; serve must run on the tensors "
            "of serving_inputs and be traceable by torch.export (no Python branch or loop on a tensor's values: "
            "use torch.where or torch.cond; docs/export.md, \"Your own model\"), or export the state dict only "
            "(--format state_dict)") from err
    sys.stderr.write(printed.getvalue())


def _where(model: nn.Module, err: BaseException) -> str:
    """`` at FILE:LINE in module PATH (CLASS)``: the innermost frame of the user's code in
    ``err``'s traceback and the innermost of ``model``'s modules running there."""
    paths = {id(m): name for name, m in model.named_modules()}
    frame_line, module = None, None
    for frame, line in traceback.walk_tb(err.__traceback__):
        owner = frame.f_locals.get("self")
        if id(owner) in paths:
            module = owner
        if not _library_file(frame.f_code.co_filename):
            frame_line = f"{frame.f_code.co_filename}:{line}"
    if frame_line is None:
        return ""
    path = paths.get(id(module), "")
    name = f"{type(module).__module__}.{type(module).__qualname__}"
    return f" at {frame_line} in module {path} ({name})" if path else f" at {frame_line}"


def _library_file(filename: str) -> bool:
    """A file of torch, torchrec, recpipe or Python's standard library (not the user's model)."""
    roots = [Path(m.__file__).parent for m in (torch, torchrec, recpipe, os)]
    return filename.startswith("<") or any(Path(filename).is_relative_to(root) for root in roots)


def export_program(cfg: RecpipeConfig, state: dict[str, torch.Tensor], out: str | Path,
                   tables: Literal["fp32", "fp16", "int8", "int4"] = "fp32",
                   metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the ``torch.export`` program of ``cfg``'s model with ``state`` to ``out``
    (written under a temporary name and renamed); returns its metadata."""
    module = serving_module(cfg, state, tables)
    if isinstance(module, UserServing):
        names, inputs, dynamic = _user_trace_spec(module)
    else:
        names, inputs = [], example_inputs(cfg.model)
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        ids = torch.export.Dim("ids", min=1)
        dynamic = {"dense_features": {0: batch}, "values": {0: ids},
                   "lengths": {0: cfg.model.num_sparse_features * batch}}
    if tables in _QUANT_DTYPES:
        register_fake_classes()
    with torch.no_grad(), _quiet_export():
        # One eager call first: TorchRec's quantized EmbeddingBagCollection and EmbeddingCollection
        # cache their features' order at their first call (a buffer made with torch.tensor(data=...),
        # which non-strict export cannot trace); the traced calls find it made.
        with _user_errors(module, "serve"):
            module(*inputs)
        # Size-oblivious reasoning for the batch: without it, torch.export's view of
        # ``lengths`` as [F, B] assumes B != 1 and guards on it, so the program refuses a
        # batch of one sample (the batch Dim's min=1 or Dim.DYNAMIC keep that guard).
        # With it the program accepts batch 1 to MAX_BATCH.
        with compat_torch.backed_size_oblivious(), _user_errors(module, "serve", tracing=True):
            program = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=False)
    _drop_unused_symbols(program)
    if isinstance(module, UserServing):
        meta = _user_meta(module, program, names)
    else:
        meta = {
            "inputs": {"dense_features": ["float32", ["B", cfg.model.num_dense_features]], "values": ["int64", ["N"]],
                       "lengths": ["int32", [f"{cfg.model.num_sparse_features} * B"]]},
            "output": ["float32", ["B"], "click probability"],
            "features": cfg.model.feature_names,
        }
    meta.update({
        "tables": tables,
        "needs": ["torch"] + (["fbgemm_gpu"] if tables in _QUANT_DTYPES else []),
        "versions": {"torch": torch.__version__},
        **(metadata or {}),
    })
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # torch.export.save wants its suffix
    try:
        torch.export.save(program, str(tmp), extra_files={"recpipe.json": json.dumps(meta, indent=2)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return meta
