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
from typing import Annotated, Any, Iterator, Union, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

__all__ = ["INT64_MAX", "FactorySpec", "Section", "SwitchSection", "factory_spec"]


INT64_MAX = 2**63 - 1


class Section(BaseModel):
    """Every number of every section is checked: a float must be finite (an lr of .inf or
    .nan is a config error, exit 2, not a run that diverges at its first step), an integer
    must fit in 64 bits (what torch's tensors and Python's iterators count with: a
    ``train.steps`` of 10**23 is refused here, not by a rank's traceback), and ``true`` /
    ``false`` are not numbers (pydantic would read ``data.batch_size=true`` as 1). Values
    are taken as their YAML type (pydantic's strict mode): a quoted ``"100"`` is a string,
    not a number, and ``1.5`` is no integer; an integer is a float. Sizes that fit in 64
    bits but not in the machine are the memory plan's to refuse (exit 3)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if _takes_a_number(cls.model_fields[info.field_name].annotation):
            for number in _leaves(value):
                if isinstance(number, bool):
                    raise ValueError(f"{str(number).lower()} is not a number")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, value: Any, info: ValidationInfo) -> Any:
        """After the field's own bounds, which name theirs (``train.seed``: below 2^63)."""
        if _takes_a_number(cls.model_fields[info.field_name].annotation):
            for number in _leaves(value):
                if isinstance(number, int) and not isinstance(number, bool) and abs(number) > INT64_MAX:
                    raise ValueError("larger than 2^63 - 1, the largest number recpipe counts with")
        return value


class SwitchSection(Section):
    """A section switched by its ``enabled`` field (a speed feature's): ``true`` / ``false``
    stand for ``{enabled: true}`` / ``{enabled: false}``."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value


def _takes_a_number(annotation: Any) -> bool:
    """Whether a field's type is, or holds, an int or a float (and not a bool)."""
    if annotation is bool:
        return False
    if annotation in (int, float):
        return True
    return any(_takes_a_number(arg) for arg in get_args(annotation))


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


_FACTORY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def factory_spec(value: str | None) -> str | None:
    """A ``package.module:function`` reference (``model.factory``, ``pipeline.inputs``, ...)."""
    if value is not None and not _FACTORY_RE.match(value):
        raise ValueError("expected 'package.module:function', e.g. 'my_models.two_tower:build'")
    return value


FactorySpec = Annotated[Union[str, None], AfterValidator(factory_spec)]
