from __future__ import annotations

import importlib.metadata as metadata

import pytest

from dflash_queue.doctor.versions import (
    check_versions,
    distribution_of,
    installed_versions,
    project_requirements,
    requirement_conflicts,
)


def test_declared_requirements_against_installed_versions():
    installed = {"torch": "2.9.0+cu128", "transformers": "5.19.0", "numpy": "2.1.0"}
    requires = [
        "torch==2.13.0+cpu; platform_machine == 'x86_64' or platform_machine == 'aarch64'",
        "torch==2.13.0; platform_system == 'Windows'",  # another platform: ignored
        "transformers<5.20,>=4.56",
        "numpy<2.0; extra == 'legacy'",  # an extra: ignored
        "tokenizers>=0.21",  # not installed: the import checks find that
    ]
    conflicts = requirement_conflicts("vllm", requires, installed)
    assert conflicts == ["vllm needs torch==2.13.0+cpu, installed 2.9.0+cu128"]
    assert requirement_conflicts("vllm", ["torch==2.9.0"], installed) == []  # a local build of the same version
    assert requirement_conflicts("vllm", ["torch>=2.10"], installed, only=["transformers"]) == []


@pytest.mark.skipif(distribution_of("vllm") is None, reason="vllm is not installed")
def test_this_environment_is_consistent():
    installed = installed_versions()
    vllm = distribution_of("vllm")
    assert requirement_conflicts(vllm, metadata.requires(vllm), installed) == []
    assert any(r.startswith("torch") for r in project_requirements())
    checks = check_versions(vllm_needed=True)
    assert [(c.name, c.verdict) for c in checks] == [("versions", "pass")]
    assert "torch" in checks[0].detail and vllm in checks[0].detail
