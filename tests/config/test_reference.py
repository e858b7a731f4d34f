"""docs/configuration.md is what the configuration models say, and every key has a description."""

from __future__ import annotations

from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.config.reference import render_reference
from dflash_queue.config.sections import Section

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def keys(model: type[Section], prefix: str = "") -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            found |= keys(annotation, f"{prefix}{name}.")
        else:
            found[f"{prefix}{name}"] = field.description
    return found


def test_the_reference_in_docs_is_current():
    assert REFERENCE.read_text(encoding="utf-8") == render_reference(), (
        "docs/configuration.md is stale: run .venv/bin/python tools/config_reference.py"
    )


def test_every_key_is_described_once_in_the_reference():
    text = render_reference()
    described = keys(Config)
    assert len(described) > 90
    assert [key for key, doc in described.items() if not doc] == []
    for key in described:
        assert text.count(f"| `{key}` |") == 1, key


def test_rows_give_type_bounds_and_default():
    text = render_reference()
    assert "| `extract.token_budget` | integer (> 0) | `16384` | Transformers engine: tokens per forward pass" in text
    assert "| `storage.url` | string (not empty) | required |" in text
    assert '| `dataset.regenerate` | `"last"` \\| `"all"` | `"last"` |' in text
    assert "| `generate.sampling.top_p` | number (> 0, <= 1) | `0.95` |" in text
    assert "## `[generate.vllm]`" in text and "## `[storage.uploader]`" in text
