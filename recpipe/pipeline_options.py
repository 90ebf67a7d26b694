"""Every pipeline's options as the config validates them: its own keys and one section per
speed feature.

A pipeline's declaration (``recpipe/pipelines/defs/``) defines its ``Options`` on the common
keys (``recpipe.runtime.options.PipelineKeys``); every speed feature registered in
``recpipe.speedups.registry`` adds its section (``pipeline.compile``, ...). The two meet
here, above both: :class:`PipelineOptions` (the common keys and the sections) is built from
the features registered when this module is imported, and :func:`options_of` gives a
pipeline's options with them. Nothing here imports torch.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field, create_model

from recpipe.runtime.definition import PipelineDef
from recpipe.runtime.options import PipelineKeys
from recpipe.speedups.registry import SPEEDUPS

__all__ = ["PipelineOptions", "SECTIONS", "options_of", "speedup_sections"]


def speedup_sections() -> dict[str, tuple[type, object]]:
    """Each registered speed feature's section, as a field of the ``pipeline`` section."""
    return {f.name: (f.options, Field(default_factory=f.options, description=f.doc))
            for f in SPEEDUPS.values() if f.options is not None}


class _ByOwnClass(PipelineKeys):
    """Options pickled by their pipeline's own class (a process that loads a config builds
    the class with the sections again): a class built by :func:`options_of` has no name to
    be imported by."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        own = _OWN.get(type(self))
        if own is None:
            return super().__reduce_ex__(protocol)
        return _rebuild, (own, self.__getstate__())


def _rebuild(own: type[PipelineKeys], state: dict[str, Any]) -> PipelineOptions:
    cls = _with_sections(own)
    options = cls.__new__(cls)
    options.__setstate__(state)
    return options


# The common keys and one section per speed feature (recpipe.speedups.registry), in its order.
PipelineOptions = create_model("PipelineOptions", __base__=_ByOwnClass, __module__=__name__,
                               __doc__=PipelineKeys.__doc__, **speedup_sections())

# The names of the speed features' sections among every pipeline's options.
SECTIONS = frozenset(PipelineOptions.model_fields) - frozenset(PipelineKeys.model_fields)


def options_of(definition: PipelineDef) -> type[PipelineOptions]:
    """The options ``definition``'s pipeline is configured by: its ``Options`` with the
    speed features' sections (the common keys first, then the sections, then its own keys)."""
    return _with_sections(definition.options)


@functools.cache
def _with_sections(options: type[PipelineKeys]) -> type[PipelineOptions]:
    if issubclass(options, PipelineOptions):
        return options
    cls = create_model(options.__name__, __base__=(options, PipelineOptions), __module__=options.__module__,
                       __doc__=options.__doc__)
    _OWN[cls] = options
    return cls


# Each class :func:`options_of` built -> the pipeline's own options class it extends.
_OWN: dict[type, type[PipelineKeys]] = {}
