"""The base of every config section, and the value types sections share.

Every section of ``recpipe.config`` and every pipeline's or speed feature's options
(``recpipe.pipelines.*``, ``recpipe.speedups.*``) derive from :class:`Section`:
pydantic, ``extra="forbid"`` (a misspelt key is an error) and frozen (a validated
config is never changed in place; overrides make a new one). This module imports
pydantic only, so the modules that own a section can define it without importing
``recpipe.config``.
"""

from __future__ import annotations

import re
from typing import Annotated, Union

from pydantic import AfterValidator, BaseModel, ConfigDict

__all__ = ["FactorySpec", "Section", "factory_spec"]


class Section(BaseModel):
    # allow_inf_nan=False: every float of every section must be finite (an lr of .inf or
    # .nan is a config error, exit 2, not a run that diverges at its first step).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def factory_spec(value: str | None) -> str | None:
    """A ``package.module:function`` reference (``model.factory``, ``pipeline.inputs``, ...)."""
    if value is not None and not _FACTORY_RE.match(value):
        raise ValueError("expected 'package.module:function', e.g. 'my_models.two_tower:build'")
    return value


FactorySpec = Annotated[Union[str, None], AfterValidator(factory_spec)]
