#!/usr/bin/env python
"""The wheels and files `tools/gpu_check.sh` needs on a GPU machine that has no registry: build them here, install
them there.

A lent GPU machine has a python3 with CUDA torch, transformers, accelerate, safetensors, tokenizers, numpy and
triton (and what those require), no registry and no network. What the Transformers extract path needs beyond
that travels in the bundle:

    build    (here)  this package as a wheel; every distribution it and the check need that the image is not
                     counted on to have (`IMAGE`), found by following each wheel's Requires-Dist: pure-Python wheels
                     once, compiled ones for each of --python-versions (manylinux x86_64); the tiny test tokenizer
                     (built locally by dfq_testing, nothing from a hub); manifest.json. Refused above --max-mib.
    install  (there) with the image's own python3: each distribution the checks need, from the package's own
                     requirements down, is taken from the image when the image has a version that satisfies what
                     asks for it, else from the bundle; the bundle's wheels go into --target (a directory for
                     PYTHONPATH) with `pip --no-index --no-deps` (or, without pip, unpacked). Then the installed
                     package is imported from --target alone, away from the checkout. Nothing is fetched.

    python tools/build_gpu_bundle.py build [--out gpu-bundle] [--python-versions 3.11,3.12,3.13]
    python3 tools/build_gpu_bundle.py install --bundle gpu-bundle --target /tmp/site [--json FILE]

The install half runs under whatever python3 the GPU machine has: standard library and `packaging` (which
transformers requires) only.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "gpu-bundle"
MANIFEST = "manifest.json"
FORMAT = 1
MIB = 2**20
DEFAULT_MAX_MIB = 48.0
DEFAULT_PYTHONS = ("3.11", "3.12", "3.13")
PACKAGE = "dflash-queue"

# Distributions the GPU image is counted on to have (its own, and what transformers, accelerate and torch
# require); never carried. The installer still checks their versions against what asks for them.
IMAGE = frozenset({
    "torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "accelerate", "huggingface-hub",
    "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "setuptools", "pyyaml", "regex",
    "tqdm", "hf-xet", "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio", "typer", "shellingham",
    "annotated-doc",
})
# What the checks need besides the package's own requirements: the extract lane's worker extra as far as the
# Transformers engine goes (the lane module imports redis for the consumption window; Celery is not imported on
# that path), the bench's process-memory sampling and TOML configs, and the Gated DeltaNet kernels the
# Transformers Qwen3.5 classes use when `fla` imports.
WORKER_NEEDS = ("transformers", "tokenizers", "accelerate", "redis")
TEST_NEEDS = ("psutil", "tomli-w")
KERNELS = ("flash-linear-attention",)
PLATFORMS = (
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
    "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
)


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_tags(filename: str) -> tuple[str, str, set[str]]:
    """(distribution, version, {python-abi-platform tags}) of a wheel file name."""
    parts = filename[: -len(".whl")].split("-")
    name, version = parts[0], parts[1]
    pythons, abis, platforms = parts[-3], parts[-2], parts[-1]
    tags = {f"{p}-{a}-{f}" for p in pythons.split(".") for a in abis.split(".") for f in platforms.split(".")}
    return canonical(name), version, tags


def wheel_metadata(path: Path) -> Any:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))


def requirements_of(path: Path) -> list[str]:
    """A wheel's Requires-Dist, those that belong to an extra left out."""
    return [r for r in wheel_metadata(path).get_all("Requires-Dist") or [] if "extra ==" not in r.replace("'", '"')]


# -----------------------------------------------------------------------------------------------------------------
# Build (here)


def marker_environment(python: str) -> dict[str, str]:
    return {
        "python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
        "platform_python_implementation": "CPython", "os_name": "posix", "extra": "",
    }


def roots() -> list[str]:
    """The package and what the checks need besides its core requirements, with this checkout's version ranges."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    chosen = [PACKAGE]
    for extra, names in (("worker", WORKER_NEEDS), ("test", TEST_NEEDS)):
        for requirement in extras[extra]:
            if canonical(Requirement(requirement).name) in names:
                chosen.append(requirement)
    return chosen + list(KERNELS)


def pip_download(requirement: str, python: str, dest: Path) -> Path:
    """One wheel for `python` on manylinux x86_64, without its dependencies, through pip's own configuration."""
    version = python.replace(".", "")
    with tempfile.TemporaryDirectory(prefix="dfq-bundle-") as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "--abi", f"cp{version}", "--abi", "abi3", "--abi", "none",
            *(arg for platform in PLATFORMS for arg in ("--platform", platform)), "--dest", tmp, requirement,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"pip download {requirement} for Python {python} failed:\n{done.stderr[-3000:]}")
        (found,) = Path(tmp).glob("*.whl")
        target = dest / found.name
        if not target.exists():
            shutil.move(str(found), target)
        return target


def is_universal(tags: set[str]) -> bool:
    """Whether one wheel serves every CPython 3 version: pure Python, or the stable ABI."""
    return all(tag.split("-")[1] in ("none", "abi3") for tag in tags)


def installed_version(name: str) -> str | None:
    import importlib.metadata as metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect(wheels: Path, pythons: list[str], package_wheel: Path) -> list[dict[str, Any]]:
    """The package's wheel and, following Requires-Dist from `roots()`, the wheels of every distribution not in
    IMAGE, each pinned to the version installed here when that satisfies every requirement on it."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    environments = [marker_environment(p) for p in pythons]
    pending = [Requirement(r) for r in roots()]
    wanted: dict[str, SpecifierSet] = {}
    chosen: dict[str, list[Path]] = {}
    while pending:
        requirement = pending.pop(0)
        name = canonical(requirement.name)
        if requirement.marker and not any(requirement.marker.evaluate(e) for e in environments):
            continue
        wanted[name] = wanted.get(name, SpecifierSet()) & requirement.specifier
        if name in IMAGE:
            continue
        if name in chosen:
            version = wheel_tags(chosen[name][0].name)[1]
            if version not in wanted[name]:
                raise SystemExit(f"{name} {version} was chosen, but something asks for {name}{wanted[name]}")
            continue
        if name == PACKAGE:
            first = package_wheel
        else:
            here = installed_version(name)
            spec = f"=={here}" if here and here in wanted[name] else str(wanted[name])
            first = pip_download(f"{name}{spec}", pythons[0], wheels)
        files = [first]
        if not is_universal(wheel_tags(first.name)[2]):
            exact = f"=={wheel_tags(first.name)[1]}"
            files += [pip_download(f"{name}{exact}", python, wheels) for python in pythons[1:]]
        chosen[name] = files
        pending.extend(Requirement(r) for r in requirements_of(first))
    return [wheel_entry(path, name) for name, files in chosen.items() for path in files]


def wheel_entry(path: Path, name: str) -> dict[str, Any]:
    _, version, tags = wheel_tags(path.name)
    return {"file": path.name, "name": name, "version": version, "tags": sorted(tags),
            "requires": requirements_of(path), "bytes": path.stat().st_size, "sha256": sha256(path),
            "pinned_here": name != PACKAGE and installed_version(name) == version}


def reusable(previous: dict[str, Any] | None, inputs: dict[str, Any], wheels: Path) -> list[dict[str, Any]] | None:
    """The previous build's wheels other than the package's, when it was made from the same inputs, each file is
    as recorded and each version pinned from this environment still is the version installed here."""
    if not previous or previous.get("inputs") != inputs:
        return None
    kept = [e for e in previous["wheels"] if e["name"] != PACKAGE]
    for entry in kept:
        path = wheels / entry["file"]
        if not path.is_file() or sha256(path) != entry["sha256"]:
            return None
        if entry["pinned_here"] and installed_version(entry["name"]) != entry["version"]:
            return None
    return kept


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_package_wheel(dest: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="dfq-wheel-") as tmp:
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                   "--no-build-isolation", "--wheel-dir", tmp, str(REPO)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"building this package's wheel failed:\n{done.stderr[-3000:]}")
        (found,) = Path(tmp).glob("*.whl")
        for old in dest.glob("dflash_queue-*.whl"):
            old.unlink()
        target = dest / found.name
        shutil.move(str(found), target)
        return target


def write_tokenizer(dest: Path, tiny: Path | None) -> list[str]:
    """The tiny test tokenizer: from a tiny model built by dfq_testing (`tiny`, else built here into
    .cache/tiny-qwen3: a byte-level BPE trained on an embedded corpus, nothing downloaded)."""
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if tiny is None:
        from dfq_testing.tiny_model import build_tiny_model

        tiny = build_tiny_model(REPO / ".cache" / "tiny-qwen3")
    shutil.rmtree(dest, ignore_errors=True)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(dest)
    return sorted(p.name for p in dest.iterdir())


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO)
        return done.stdout.strip() if done.returncode == 0 else ""

    # Dirty: what goes into the package's wheel differs from the commit.
    changed = git("status", "--porcelain", "--", "dflash_queue", "pyproject.toml")
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(changed)}


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def build(args: argparse.Namespace) -> int:
    out: Path = args.out.resolve()
    pythons = [p.strip() for p in args.python_versions.split(",") if p.strip()]
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    package_wheel = build_package_wheel(wheels)
    inputs = {"format": FORMAT, "roots": roots(), "python_versions": pythons, "image": sorted(IMAGE),
              "package_requires": requirements_of(package_wheel)}
    previous = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else None
    kept_entries = reusable(previous, inputs, wheels)
    if kept_entries is None:
        entries = collect(wheels, pythons, package_wheel)
    else:
        entries = [wheel_entry(package_wheel, PACKAGE), *kept_entries]
        print(f"reused the wheels of {out / MANIFEST} (the same inputs); rebuilt this package's")
    kept = {e["file"] for e in entries}
    for stale in wheels.glob("*.whl"):
        if stale.name not in kept:
            stale.unlink()
    tokenizer = write_tokenizer(out / "tokenizer", args.tokenizer_from)
    manifest = {
        "inputs": inputs,
        "format": FORMAT,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_commit(),
        "python_versions": pythons,
        "requires_python": wheel_metadata(package_wheel).get("Requires-Python"),
        "roots": roots(),
        "image": sorted(IMAGE),
        "wheels": entries,
        "tokenizer": {"dir": "tokenizer", "files": tokenizer},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    size = folder_bytes(out)
    names = sorted({e["name"] for e in entries})
    print(f"bundle {out}: {len(entries)} wheels ({', '.join(names)}), tokenizer, manifest; {size / MIB:.1f} MiB "
          f"(at most {args.max_mib:g}); Python {', '.join(pythons)}; built in {time.perf_counter() - started:.0f} s")
    if size > args.max_mib * MIB:
        largest = sorted(entries, key=lambda e: -e["bytes"])[:5]
        raise SystemExit(f"the bundle is {size / MIB:.1f} MiB, over {args.max_mib:g} MiB; largest wheels: "
                         + ", ".join(f"{e['file']} {e['bytes'] / MIB:.1f} MiB" for e in largest))
    return 0


# -----------------------------------------------------------------------------------------------------------------
# Install (on the GPU machine, with its own python3)


def plan_install(manifest: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(the bundle's wheels to install for this interpreter, the distributions taken from the image), following
    requirements from the manifest's roots; a requirement neither satisfies is an error naming it."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.tags import sys_tags

    supported = {str(tag) for tag in sys_tags()}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for entry in manifest["wheels"]:
        by_name.setdefault(entry["name"], []).append(entry)
    pending = [Requirement(r) for r in manifest["roots"]]
    wanted: dict[str, SpecifierSet] = {}
    install: dict[str, dict[str, Any]] = {}
    image: dict[str, dict[str, str]] = {}
    while pending:
        requirement = pending.pop(0)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonical(requirement.name)
        wanted[name] = wanted.get(name, SpecifierSet()) & requirement.specifier
        spec = wanted[name]
        if name in install or name in image:
            version = install[name]["version"] if name in install else image[name]["version"]
            if not spec.contains(version, prereleases=True):
                where = "the bundle's" if name in install else "the image's"
                raise SystemExit(f"{where} {name} {version} does not satisfy {name}{spec}")
            continue
        try:
            have = metadata.version(name) if name != PACKAGE else None
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and spec.contains(have, prereleases=True):
            image[name] = {"name": name, "version": have, "required": str(spec) or "any"}
            continue
        candidates = [e for e in by_name.get(name, []) if supported & set(e["tags"])]
        if not candidates:
            found = f"the image has {name} {have}" if have else f"the image has no {name}"
            carried = "the bundle carries none" if name not in by_name else (
                "the bundle has no wheel for this interpreter (" + ", ".join(e["file"] for e in by_name[name]) + ")")
            raise SystemExit(f"{name}{spec} is needed: {found} and {carried}")
        entry = candidates[0]
        if not spec.contains(entry["version"], prereleases=True):
            raise SystemExit(f"the bundle's {entry['file']} does not satisfy {name}{spec}")
        install[name] = entry
        pending.extend(Requirement(r) for r in entry["requires"])
    return list(install.values()), sorted(image.values(), key=lambda d: d["name"])


def unpack(wheel: Path, target: Path) -> None:
    """A wheel installed by hand (no pip): its files into target, its .data/purelib and platlib beside them."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    for data in target.glob("*.data"):
        for scheme in ("purelib", "platlib"):
            for item in (data / scheme).glob("*") if (data / scheme).is_dir() else []:
                destination = target / item.name
                if destination.exists():
                    shutil.rmtree(destination) if destination.is_dir() else destination.unlink()
                shutil.move(str(item), destination)
        shutil.rmtree(data)


IMPORT_CHECK = (
    "import dflash_queue, dflash_queue.config, dflash_queue.lanes.extract, dflash_queue.engines.hf.extract, "
    "dflash_queue.storage, dflash_queue.training; print(dflash_queue.__file__)"
)


def install(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    bundle, target = args.bundle.resolve(), args.target.resolve()
    manifest = json.loads((bundle / MANIFEST).read_text())
    python = ".".join(map(str, sys.version_info[:3]))
    requires_python = manifest.get("requires_python")
    if requires_python:
        from packaging.specifiers import SpecifierSet

        if python not in SpecifierSet(requires_python):
            raise SystemExit(f"this package needs Python {requires_python}; {sys.executable} is Python {python}")
    wheels, image = plan_install(manifest)
    files = [bundle / "wheels" / e["file"] for e in wheels]
    target.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, env=env)
    if pip.returncode == 0:
        how = pip.stdout.split(" from ")[0]
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
                   "--upgrade", "--target", str(target), *map(str, files)]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"pip install from the bundle failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        log = done.stdout + done.stderr
    else:
        how = "unpacked (no pip)"
        for path in files:
            unpack(path, target)
        log = ""
    check_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check_env["PYTHONPATH"] = str(target)
    with tempfile.TemporaryDirectory(prefix="dfq-import-") as away:  # not the checkout: the installed package
        imported = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True,
                                  cwd=away, env=check_env)
    if imported.returncode != 0:
        raise SystemExit(f"the installed package does not import:\n{imported.stderr[-3000:]}")
    location = imported.stdout.strip()
    if not Path(location).resolve().is_relative_to(target):
        raise SystemExit(f"dflash_queue imported from {location}, not from {target}")
    report = {
        "python": python, "executable": sys.executable, "bundle": str(bundle),
        "bundle_commit": manifest.get("commit"), "bundle_dirty": manifest.get("dirty"),
        "bundle_built": manifest.get("built"), "target": str(target), "installer": how,
        "installed": [{"name": e["name"], "version": e["version"], "file": e["file"]} for e in wheels],
        "from_image": image, "fetched": [line for line in log.splitlines() if "Downloading" in line or "http" in line],
        "import_check": location, "seconds": time.perf_counter() - started,
    }
    print(f"installed from the bundle into {target} with {how}: "
          + ", ".join(f"{e['name']} {e['version']}" for e in wheels))
    print("taken from the image: " + ", ".join(f"{d['name']} {d['version']}" for d in image))
    print(f"dflash_queue imports from {location} (built from commit {manifest.get('commit')}"
          f"{', with uncommitted changes' if manifest.get('dirty') else ''})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="build the bundle here (pip download, this package's wheel, tokenizer)")
    make.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the bundle's folder (default: gpu-bundle/)")
    make.add_argument("--python-versions", default=",".join(DEFAULT_PYTHONS),
                      help="CPython versions compiled wheels are carried for (default 3.11,3.12,3.13)")
    make.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help="refuse a larger bundle (default 48)")
    make.add_argument("--tokenizer-from", type=Path,
                      help="a tiny model dfq_testing built (default: build one into .cache/tiny-qwen3)")
    put = commands.add_parser("install", help="install the bundle for this interpreter, offline")
    put.add_argument("--bundle", type=Path, default=DEFAULT_OUT)
    put.add_argument("--target", type=Path, required=True, help="the directory to put on PYTHONPATH")
    put.add_argument("--json", help="write what was installed and taken from the image to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return build(args) if args.command == "build" else install(args)


if __name__ == "__main__":
    raise SystemExit(main())
