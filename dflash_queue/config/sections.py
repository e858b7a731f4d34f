"""The base of every configuration section, and the value types sections share.

Each component declares its own section next to its code (`storage/config.py`, `queue/config.py`, ...);
`dflash_queue.config` assembles them into one TOML file's `Config`. Sections forbid unknown keys, check types
strictly and are frozen; a field's docstring is its description (`docs/configuration.md` is generated from
them).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


def _array_to_tuple(value: Any) -> Any:
    # TOML arrays load as lists; the frozen config keeps tuples.
    return tuple(value) if isinstance(value, list) else value


StrTuple = Annotated[tuple[str, ...], BeforeValidator(_array_to_tuple)]
LayerIds = Annotated[tuple[Annotated[int, Field(ge=0)], ...], BeforeValidator(_array_to_tuple)]
