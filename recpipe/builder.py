"""Builds the pipeline a config asks for: :func:`make_pipeline`.

The builder sits above both the pipelines (``recpipe.pipelines``) and the speed features
(``recpipe.speedups``), which know nothing of each other: it builds the engine class the
pipeline's definition names (or the user's subclass of it, ``pipeline.class``) with the
pipeline's options, then applies every speed feature the ``pipeline`` section enables,
in the registry's order, to a pipeline that offers the capabilities the feature needs
(``recpipe.capabilities``). ``recpipe.preflight`` refuses the same configs before launch;
here a refusal is a ``PipelineError`` (a pipeline built without the preflight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recpipe.callables import load_callable
from recpipe.errors import ConfigError, PipelineError, job_warning
from recpipe.pipeline_options import PipelineOptions, section_names
from recpipe.pipelines.registry import PIPELINES
from recpipe.runtime.engine import Pipeline
from recpipe.speedups.registry import SPEEDUPS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from recpipe.config import RecpipeConfig

__all__ = ["apply_speedups", "engine_options", "make_pipeline", "pipeline_class"]

# What the builder resolves itself (``class``, ``inputs``); the speed features' sections and keys
# are applied from outside too.
_RESOLVED_HERE = frozenset({"name", "class_", "inputs"})


def pipeline_class(cfg: "RecpipeConfig") -> type[Pipeline]:
    """The class ``cfg`` builds: ``pipeline.class`` (imported; ConfigError unless it is a
    subclass of the pipeline's engine class), else the engine class ``pipeline.name``'s
    definition names."""
    name, spec = cfg.pipeline.name, cfg.pipeline.class_
    engine = PIPELINES[name].engine_class()
    if spec is None:
        return engine
    cls = load_callable(spec, "pipeline.class")
    if not (isinstance(cls, type) and issubclass(cls, engine)):
        what = f"a {type(cls).__name__}" if not isinstance(cls, type) else f"class {cls.__name__}, whose bases are " \
            f"{', '.join(b.__name__ for b in cls.__mro__[1:-1]) or 'none'}"
        raise ConfigError(f"pipeline.class={spec!r} is {what}, not a subclass of {engine.__name__}, the class of "
                          f"pipeline.name={name!r}: subclass {engine.__module__}.{engine.__name__}, or set "
                          "pipeline.name to the pipeline it extends")
    return cls


def make_pipeline(cfg: "RecpipeConfig", model: "nn.Module", optimizer: "torch.optim.Optimizer",
                  device: "torch.device", cls: type | None = None) -> Pipeline:
    """The pipeline ``cfg.pipeline`` names, built as ``cls`` (a subclass of its class; default
    :func:`pipeline_class`) with its options and its ``inputs`` functions imported, and the
    speed features of ``cfg.pipeline`` applied to it and to ``model``."""
    options = cfg.pipeline
    definition = PIPELINES[options.name]
    if cls is None:
        cls = pipeline_class(cfg)
    elif not (isinstance(cls, type) and issubclass(cls, definition.engine_class())):
        raise PipelineError(f"make_pipeline(cls={cls!r}): not a subclass of {definition.engine_class().__name__}, the "
                            f"class of pipeline.name={options.name!r}")
    inputs = {fqn: load_callable(spec, f"pipeline.inputs.{fqn}") for fqn, spec in options.inputs.items()}
    if inputs and not definition.intercepts:
        job_warning(f"pipeline.inputs is ignored by pipeline.name={options.name!r}: the model runs its own forward")
        inputs = {}
    pipeline = cls(model, optimizer, device, definition=definition, inputs=inputs,
                   **engine_options(options))
    pipeline.applied = apply_speedups(pipeline, options)
    return pipeline


def engine_options(options: PipelineOptions) -> dict[str, Any]:
    """The keyword arguments of a pipeline's engine for ``options``: the pipeline's own keys
    and the common ones, not the speed features' sections (applied from outside) nor
    ``class`` and ``inputs`` (resolved here)."""
    outside = _RESOLVED_HERE | section_names() | {f.key for f in SPEEDUPS.values() if f.key is not None}
    return {k: getattr(options, k) for k in type(options).model_fields if k not in outside}


def apply_speedups(pipeline: Pipeline, options: PipelineOptions) -> list[Any]:
    """Apply the speed features ``options`` (a ``pipeline`` section) enables to ``pipeline``
    and its model, in the registry's order (a feature with a common key: given its value);
    returns their handles (printable, with ``remove()``). A feature whose needs the pipeline does not offer is refused
    (``PipelineError``), or skipped where it has nothing to speed up there."""
    applied: list[Any] = []
    offers = pipeline.definition.offers
    for feature in SPEEDUPS.values():
        if not feature.enabled(options):
            continue
        lacking = feature.lacking(offers)
        if lacking and feature.missing == "skip":
            continue
        if lacking:
            raise PipelineError(f"pipeline.{feature.name} needs {', '.join(lacking)}, which pipeline "
                                f"{pipeline.name!r} does not offer")
        apply = load_callable(feature.apply, f"speed feature {feature.name!r}")
        handle = apply(pipeline.context, feature.section(options))
        if handle is not None:
            applied.append(handle)
    return applied
