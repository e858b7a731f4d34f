"""The configuration reference (`docs/configuration.md`), generated from the section models: every key with
its type, constraints, default and the field's docstring. `python tools/config_reference.py` writes it; a test
fails when the file differs from what the models give."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterable
from typing import Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dflash_queue.config import BROKER_URL_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV, STORAGE_URL_ENV, Config
from dflash_queue.config.sections import Section

HEADER = f"""# Configuration reference

Generated from the configuration models (`dflash_queue/*/config.py`, assembled in `dflash_queue/config/loading.py`) by
`.venv/bin/python tools/config_reference.py`; edit the field docstrings, not this file.

One TOML file per deployment. Unknown keys, wrong types and impossible values fail at load with the file and
the dotted key. Relative paths resolve against the config file. `{BROKER_URL_ENV}` and `{STORAGE_URL_ENV}`
override `broker.url` and `storage.url`. Credentials never go in the file (S3: the AWS chain; Flower:
`FLOWER_BASIC_AUTH`; the broker: `{PASSWORD_ENV}`, or a file named by `{PASSWORD_FILE_ENV}` or
`broker.password_file`).
"""


def render_reference(root: type[BaseModel] = Config) -> str:
    parts = [HEADER]
    for name, field in root.model_fields.items():
        if field.exclude:
            continue
        section = _section_type(field)
        if section is not None:
            parts.extend(_render_section(name, section))
    return "\n".join(parts).rstrip() + "\n"


def _render_section(prefix: str, model: type[BaseModel]) -> list[str]:
    out = [f"## `[{prefix}]`", ""]
    doc = _own_doc(model)
    if doc:
        out += [doc, ""]
    rows, subsections = [], []
    for name, field in model.model_fields.items():
        section = _section_type(field)
        if section is not None:
            subsections.append((f"{prefix}.{name}", section))
            continue
        rows.append(
            f"| `{prefix}.{name}` | {_type(field)} | {_default(field)} | {_cell(field.description or '')} |"
        )
    if rows:
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for sub_prefix, section in subsections:
        out += _render_section(sub_prefix, section)
    return out


def _section_type(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def _own_doc(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if not doc or doc == BaseModel.__doc__ or doc == Section.__doc__:
        return ""
    return " ".join(line.strip() for line in doc.strip().splitlines() if line.strip())


def _type(field: FieldInfo) -> str:
    return _bounded(_type_name(field.annotation), field.metadata)


def _bounded(name: str, metadata: Iterable[Any]) -> str:
    """`name` followed by the constraints in `metadata` (`integer (> 0)`)."""
    bounds = [b for b in (_bound(item) for item in metadata) if b]
    return f"{name} ({', '.join(bounds)})" if bounds else name


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in get_args(annotation))
    if origin is typing.Annotated:
        base, *metadata = get_args(annotation)
        return _bounded(_type_name(base), metadata)
    if origin in (tuple, list):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        key, value = get_args(annotation)
        return f"table of {_type_name(key)} = {_type_name(value)}"
    if isinstance(annotation, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def _bound(item: Any) -> str:
    for kind, attribute, symbol in ((Gt, "gt", ">"), (Ge, "ge", ">="), (Lt, "lt", "<"), (Le, "le", "<=")):
        if isinstance(item, kind):
            return f"{symbol} {getattr(item, attribute)}"
    if isinstance(item, MinLen):
        return "not empty" if item.min_length == 1 else f"at least {item.min_length} long"
    if isinstance(item, MaxLen):
        return f"at most {item.max_length} long"
    pattern = getattr(item, "pattern", None)
    if isinstance(pattern, str):
        return f"matching `{pattern}`"
    return ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default  # type: ignore[call-arg,misc]
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
