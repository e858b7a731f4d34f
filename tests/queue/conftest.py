"""What the broker section's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfq_testing.configs import to_toml


@pytest.fixture
def write(tmp_path: Path):
    """A deployment config with this `[broker]` table (and a model directory it points at): call it with the table."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 4}')

    def write(broker: dict) -> Path:
        path = tmp_path / "deploy.toml"
        path.write_text(to_toml({"storage": {"url": "out"}, "model": {"path": str(model)}, "broker": broker}))
        return path

    return write
