"""The run's storage layout is spelt in one place, shards/keys.py: no other module of the package names a folder
of it in a string, composes a key from its folder names or suffixes, or re-spells a suffix beside them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dflash_queue
from dflash_queue.shards.keys import (
    CONSUMED,
    EPOCHS,
    MARK_SUFFIX,
    PROMPTS,
    RECORDS_SUFFIX,
    SHARD_SUFFIX,
    SHARDS,
    SUSPECT,
    completions_keys,
    consumed_keys,
    epoch_shard_keys,
    prompts_keys,
    split_shard_path,
    suspect_mark_of,
)

PACKAGE = Path(dflash_queue.__file__).parent
KEYS_MODULE = PACKAGE / "shards" / "keys.py"
FOLDERS = (PROMPTS, "completions", SHARDS, EPOCHS, CONSUMED, SUSPECT)
SPELT_KEY = re.compile(rf"^({'|'.join(FOLDERS)})/")
LAYOUT_NAMES = {"PROMPTS", "COMPLETIONS", "SHARDS", "EPOCHS", "CONSUMED", "SUSPECT", "RECORDS_SUFFIX", "SHARD_SUFFIX",
                "MARK_SUFFIX"}
SUFFIXES = {RECORDS_SUFFIX, SHARD_SUFFIX}


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the string nodes that are docstrings (they may name a key as an example)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def layout_spelt_outside_keys(source: str, name: str) -> list[str]:
    """What in `source` (a module of the package) spells the storage layout itself, one line each."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    imports_layout = any(
        isinstance(node, ast.ImportFrom) and node.module == "dflash_queue.shards.keys" for node in ast.walk(tree)
    )
    # A suffix tested on a key (`key.endswith(".safetensors")`) or named on its own (`SUFFIX = ".jsonl"`): a
    # module that reads the run's storage would be re-spelling the layout's; a set of dataset file types is not.
    suffix_uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "endswith":
            suffix_uses.update(id(arg) for arg in node.args)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            suffix_uses.add(id(node.value))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "dflash_queue.shards.keys":
            problems += [f"{name}:{node.lineno}: imports {a.name}" for a in node.names if a.name in LAYOUT_NAMES]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if SPELT_KEY.match(node.value):
                problems.append(f"{name}:{node.lineno}: spells the key {node.value!r}")
            if imports_layout and node.value in SUFFIXES and id(node) in suffix_uses:
                problems.append(f"{name}:{node.lineno}: spells the suffix {node.value!r} beside the layout's keys")
    return problems


def test_no_module_but_shards_keys_spells_the_storage_layout():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != KEYS_MODULE:
            problems += layout_spelt_outside_keys(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    assert problems == []


def test_the_check_sees_each_way_of_re_spelling_a_key():
    spelt = '''
from dflash_queue.shards.keys import COMPLETIONS, shard_id_of
"""A docstring may say shards/x.safetensors."""
def a(storage):
    return storage.list(COMPLETIONS + "/")
def b(storage):
    return [k for k in storage.list("shards/") if k.endswith(".safetensors")]
'''
    assert layout_spelt_outside_keys(spelt, "m.py") == [
        "m.py:2: imports COMPLETIONS",
        "m.py:7: spells the key 'shards/'",
        "m.py:7: spells the suffix '.safetensors' beside the layout's keys",
    ]
    assert layout_spelt_outside_keys('from dflash_queue.shards.keys import is_shard_key\nSUFFIX = ".jsonl"\n', "m.py") == [
        "m.py:2: spells the suffix '.jsonl' beside the layout's keys"]
    # A module that does not read the run's storage may name its own files' suffix (a checkpoint's weights), and
    # one that does may list the file types of datasets.
    assert layout_spelt_outside_keys('from pathlib import Path\nGLOB = "*" + ".safetensors"\n', "m.py") == []
    assert layout_spelt_outside_keys('from dflash_queue.shards.keys import is_shard_key\nTYPES = {".jsonl", ".gz"}\n',
                                     "m.py") == []


class Listing:
    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def list(self, prefix: str) -> list[str]:
        return [k for k in self.keys if k.startswith(prefix)]


def test_the_listings_take_only_their_own_kind_of_key():
    storage = Listing([
        "prompts/b.jsonl", "prompts/a.jsonl", "prompts/a.jsonl.partial", "completions/a.jsonl",
        "shards/a.safetensors", "shards/.a.safetensors.tmp", "epochs/1/shards/a.safetensors",
        "consumed/0/a.json", "consumed/1/b.json", "suspect/0/a.json",
    ])
    assert prompts_keys(storage) == ["prompts/a.jsonl", "prompts/b.jsonl"]
    assert completions_keys(storage) == ["completions/a.jsonl"]
    assert epoch_shard_keys(storage, 0) == ["shards/a.safetensors"]
    assert epoch_shard_keys(storage, 1) == ["epochs/1/shards/a.safetensors"]
    assert consumed_keys(storage, 1) == ["consumed/1/b.json"]
    assert suspect_mark_of("suspect/0/a.json") == (0, "a") and suspect_mark_of("suspect/x/a.json") is None
    assert split_shard_path(["run", "epochs", "2", "shards", "a.safetensors"]) == (["run"], 2, "a")
    assert split_shard_path(["run", "shards", "a.safetensors"]) == (["run"], 0, "a")
    assert split_shard_path(["run", "completions", "a.jsonl"]) is None
    assert MARK_SUFFIX == ".json"
