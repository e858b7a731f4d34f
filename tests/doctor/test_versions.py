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
    # An extra's requirements count when that extra is asked for.
    worker = ["transformers<5.0; extra == 'worker'"]
    assert requirement_conflicts("dflash-queue", worker, installed) == []
    assert requirement_conflicts("dflash-queue", worker, installed, extras=["worker"]) == [
        "dflash-queue needs transformers<5.0, installed 5.19.0"
    ]


@pytest.mark.skipif(distribution_of("vllm") is None, reason="vllm is not installed")
def test_this_environment_is_consistent():
    installed = installed_versions()
    vllm = distribution_of("vllm")
    assert requirement_conflicts(vllm, metadata.requires(vllm), installed) == []
    requirements, extras = project_requirements()
    assert any(r.startswith("torch") for r in requirements)
    # transformers is required by the `worker` extra, and checked with it.
    assert "worker" in extras and any(r.startswith("transformers") and "worker" in r for r in requirements)
    checks = check_versions(vllm_needed_by=("generate", "extract"))
    assert [(c.name, c.verdict) for c in checks] == [("versions", "pass")]
    assert "torch" in checks[0].detail and vllm in checks[0].detail
