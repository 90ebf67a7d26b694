"""Every pipeline's options as the config validates them: its own keys and one section per
speed feature.

A pipeline's declaration (``recpipe/pipelines/defs/``) defines its ``Options`` on the common
keys (``recpipe.runtime.options.PipelineKeys``); every speed feature registered in
``recpipe.speedups.registry`` adds its section (``pipeline.compile``, ...). The two meet
here, above both, when first needed: :func:`options_model` (the common keys and the
sections) and :func:`options_of` (a pipeline's options with them) are built from the
features registered at the time of the call, and built again after a registration, so a
trainer script may register a feature whenever it likes before its config is loaded.
Every class built here derives from :class:`PipelineOptions`. Nothing here imports torch.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field, create_model

from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.speedups.registry import SPEEDUPS

__all__ = ["PipelineOptions", "options_model", "options_of", "section_names", "speedup_sections"]


def speedup_sections() -> dict[str, tuple[type, object]]:
    """Each registered speed feature's section, as a field of the ``pipeline`` section."""
    return {f.name: (f.options, Field(default_factory=f.options, description=f.doc))
            for f in SPEEDUPS.values() if f.options is not None}


def section_names() -> frozenset[str]:
    """The names of the registered speed features' sections among every pipeline's options."""
    return frozenset(f.name for f in SPEEDUPS.values() if f.options is not None)


class PipelineOptions(PipelineKeys):
    """The base of every pipeline's options built here (the common keys; the sections are
    added by :func:`options_model`). Pickled by the pipeline's own class: a process that
    loads a config builds the class with its sections again, as a class built here has no
    name to be imported by."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        own = _OWN.get(type(self))
        if own is None:
            return super().__reduce_ex__(protocol)
        return _rebuild, (own, self.__getstate__())


def _rebuild(own: type[PipelineKeys], state: dict[str, Any]) -> PipelineOptions:
    cls = _with_sections(own, _registered())
    options = cls.__new__(cls)
    options.__setstate__(state)
    return options


def _registered() -> tuple[tuple[str, type], ...]:
    """The registered sections, in the registry's order: what the built classes are cached by."""
    return tuple((f.name, f.options) for f in SPEEDUPS.values() if f.options is not None)


def options_model() -> type[PipelineOptions]:
    """The common keys and one section per registered speed feature, in the registry's order."""
    return _common(_registered())


@functools.cache
def _common(registered: tuple[tuple[str, type], ...]) -> type[PipelineOptions]:
    return create_model("PipelineOptions", __base__=PipelineOptions, __module__=__name__,
                        __doc__=PipelineKeys.__doc__, **speedup_sections())


def options_of(definition: PipelineDef) -> type[PipelineOptions]:
    """The options ``definition``'s pipeline is configured by: its ``Options`` with the
    speed features' sections (the common keys first, then the sections, then its own keys)."""
    return _with_sections(definition.options, _registered())


@functools.cache
def _with_sections(options: type[PipelineKeys], registered: tuple[tuple[str, type], ...]) -> type[PipelineOptions]:
    if options in _OWN:
        return options
    cls = create_model(options.__name__, __base__=(options, _common(registered)), __module__=options.__module__,
                       __doc__=options.__doc__)
    _OWN[cls] = options
    return cls


# Each class :func:`options_of` built -> the pipeline's own options class it extends.
_OWN: dict[type, type[PipelineKeys]] = {}
