"""Configuration: one TOML file per deployment, loaded into frozen, validated sections.

`sections` holds the base every component's section builds on (`storage/config.py`, `queue/config.py`, ...);
`loading` assembles those sections into one file's `Config` and loads it; `reference` renders
`docs/configuration.md` from them. The components import `sections` while `loading` imports the components, so
this package imports `loading` only when one of its names is first asked for: importing a component's section
never drags in the whole assembly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_queue.config.loading import (
        BROKER_URL_ENV,
        PASSWORD_ENV,
        PASSWORD_FILE_ENV,
        STORAGE_URL_ENV,
        AuditConfig,
        BrokerConfig,
        Config,
        DatasetConfig,
        ExtractConfig,
        ExtractVllmConfig,
        FlowerConfig,
        GenerateConfig,
        ModelConfig,
        QualityConfig,
        RunConfig,
        S3Config,
        SamplingConfig,
        StorageConfig,
        UploaderConfig,
        VllmConfig,
        load_config,
    )

__all__ = [
    "BROKER_URL_ENV",
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "STORAGE_URL_ENV",
    "AuditConfig",
    "BrokerConfig",
    "Config",
    "DatasetConfig",
    "ExtractConfig",
    "ExtractVllmConfig",
    "FlowerConfig",
    "GenerateConfig",
    "ModelConfig",
    "QualityConfig",
    "RunConfig",
    "S3Config",
    "SamplingConfig",
    "StorageConfig",
    "UploaderConfig",
    "VllmConfig",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("dflash_queue.config.loading"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
