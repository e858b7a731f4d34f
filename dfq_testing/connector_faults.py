"""Faults put into the vLLM extract engine's KV connector from outside the package, inside vLLM's own processes.

The package has faults of its own (the connector's `kv_connector_extra_config["faults"]`, dflash_queue/faults.py);
these share nothing with them: nothing in `dflash_queue` is changed, its faults and settings are unused. A process
started with `SITE_DIR` on PYTHONPATH and `RULES_ENV` holding a JSON list of rules runs `SITE_DIR/sitecustomize.py`
as it starts, which puts an import hook first in `sys.meta_path`: when `dflash_queue.engines.vllm.states_connector`
is imported (by vLLM's engine core or model worker, a `dflash-queue worker`, `run` ...),
`HiddenStatesConnector._gather` and `_send` are wrapped before anyone uses the class. Without the variable the hook
is not installed and nothing is imported. The rules are read once, as the process starts (a process forked from it
has its parent's).

- A subprocess (`dflash-queue run`, a worker): `subprocess.run(cmd, env=environment(RULES))`.
- An engine the test process starts (`VllmStateExtractor`, which spawns its engine core):
  `with installed(RULES): engine = VllmStateExtractor(...)`. A spawned process runs site initialisation again; a
  forked one does not: `vllm_forked_engine_cores` forks engine cores from a fork server started earlier without the
  hook, so a module using these faults leaves that fixture out (its engine core is spawned, ~12 CPU-seconds).

Another `sitecustomize` on the path after `SITE_DIR` (a venv's, a profiler's) still runs: ours loads it after
installing the hook (`sitecustomize` in sys.modules is then that one).

The connector's `_gather(transfer)` returns a finished sequence's rows of the hidden-state cache, [tokens, K_aux, H]
on the cache's device, its K columns vLLM's aux layer ids in ascending order (the engine asks for them sorted:
`eagle_aux_hidden_state_layer_ids` of the speculative config's draft model); aux id k is the residual stream before
decoder layer k, so decoder layer i's output is aux id i + 1 and aux id N (N layers) the last layer's output before
the final norm, from which the extract worker makes both the `last_layer` and the `final_norm` entries (and a
`decoder_output` entry of layer N - 1). `_send` computes the statistics from what `_gather` returned and writes the
file, so the worker's checks of the file (token ids, shapes, statistics, unwritten rows) see faulted states as
consistent as a real bug's would be.

Rules, applied in order, each `{"kind": ..., "samples": "<regex>"}` (`samples` optional: a `re.fullmatch` on the
request's sample id, `StatesTransfer.sample`; without it every request, the canary's reruns alone and the engine's
load-time probes included: these stand for bugs that are the same batched and alone):

- `deepest_layer_offset`: the column of the highest aux id below N (the deepest captured decoder layer other than
  the last: the last's column, aux N, also carries the last-layer and final-norm entries; aux N itself if it is the
  only one) one token off: row t holds row t - 1's state, row 0 keeps its own; every other column untouched.
- `last_layer_after_norm`: the aux-N column replaced by the model's final RMSNorm applied to it (the state taken
  after the final norm instead of before), with the checkpoint's own norm weight (`model.norm.weight`, or a
  multimodal checkpoint's `model.language_model.norm.weight`) and `rms_norm_eps`, read from the model directory vLLM
  was given (`vllm_config.model_config.model`), computed as Llama's and Qwen's RMSNorm compute it (in float32, the
  weight times the result back in the cache's dtype). Llama/Qwen-style norms only (Gemma's 1 + weight is not this).
  Refused (the sequence's `.error` file) when aux N is not gathered.
- `slot_offset_after` with `"position": P`: rows at positions >= P read one slot on, every column (row t holds
  row t + 1's state; the last row keeps its own), as a slot-mapping bug at a prefill chunk's boundary would.
- `swap` with `"pairs": [["a", "b"], ...]`: two requests' states exchanged, each file holding its own request's
  token ids and the other's rows. The first of a pair to finish is held (its blocks stay allocated, nothing is
  written) until its partner finishes; then both are gathered (with the row rules above) and each is handed over
  with the other's rows. Partners of different lengths get both an `.error` file. A pair's sample rerun alone (the
  canary) is handed over as computed: a request alone has no batch to be mixed with.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RULES_ENV = "DFQ_TEST_CONNECTOR_FAULTS"
SITE_DIR = Path(__file__).resolve().with_name("connector_faults_site")
TARGET_MODULE = "dflash_queue.engines.vllm.states_connector"
TARGET_CLASS = "HiddenStatesConnector"
# Set on the wrapped class: the rules it was wrapped with (what a test reads to see that a process has the patch).
PATCHED_ATTR = "_dfq_outside_faults"
_STATE_ATTR = "_dfq_outside_faults_state"  # each connector's own (_Faults)
KINDS = ("deepest_layer_offset", "last_layer_after_norm", "slot_offset_after", "swap")
# Where the final norm's weight is in a checkpoint: a text decoder's, a multimodal model's text decoder's.
NORM_WEIGHT_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")

# Under vLLM's logger, whose handler prints from vLLM's processes.
log = logging.getLogger(f"vllm.{__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Rules and the environment that carries them


def validate(rules: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rules as plain JSON values, each checked (kind, its fields, a compilable `samples` regex)."""
    checked: list[dict[str, Any]] = []
    partnered: set[str] = set()
    for number, given in enumerate(rules):
        rule = dict(given)
        kind = rule.get("kind")
        if kind not in KINDS:
            raise ValueError(f"connector fault rule {number}: kind {kind!r} is not one of {', '.join(KINDS)}")
        allowed = {"kind", "samples"} | {"slot_offset_after": {"position"}, "swap": {"pairs"}}.get(kind, set())
        unknown = sorted(set(rule) - allowed)
        if unknown:
            raise ValueError(f"connector fault rule {number} ({kind}): unknown keys {unknown}")
        if "samples" in rule:
            re.compile(rule["samples"])
        if kind == "slot_offset_after" and not (isinstance(rule.get("position"), int) and rule["position"] >= 0):
            raise ValueError(f"connector fault rule {number}: slot_offset_after needs a position >= 0")
        if kind == "swap":
            pairs = rule.get("pairs")
            if not pairs or any(len(pair) != 2 or pair[0] == pair[1] for pair in pairs):
                raise ValueError(f"connector fault rule {number}: swap needs pairs of two distinct sample ids")
            named = [str(sample) for pair in pairs for sample in pair]
            if len(set(named)) != len(named) or partnered & set(named):
                raise ValueError(f"connector fault rule {number}: a sample is in more than one swap pair")
            partnered |= set(named)
            rule["pairs"] = [[str(a), str(b)] for a, b in pairs]
        checked.append(rule)
    return checked


def environment(rules: Sequence[Mapping[str, Any]], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) whose processes wrap the connector with `rules`: SITE_DIR first on
    PYTHONPATH, the rules' JSON in RULES_ENV."""
    env = dict(os.environ if base is None else base)
    path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *path])
    env[RULES_ENV] = json.dumps(validate(rules))
    return env


@contextmanager
def installed(rules: Sequence[Mapping[str, Any]]) -> Iterator[None]:
    """Processes started from this one inside the block (by spawn or exec, not fork) wrap the connector with
    `rules`; os.environ is put back when the block ends (an engine started inside keeps its faults)."""
    wanted = environment(rules)
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", RULES_ENV)}
    os.environ.update({name: wanted[name] for name in saved})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def rules_from_environment() -> list[dict[str, Any]] | None:
    text = os.environ.get(RULES_ENV, "")
    return validate(json.loads(text)) if text.strip() else None


# ---------------------------------------------------------------------------------------------------------------
# The import hook (installed by SITE_DIR/sitecustomize.py)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds the connector module through the finders after it and wraps the class once the module has run."""

    def __init__(self, rules: list[dict[str, Any]]) -> None:
        self.rules = rules

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.rules)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, rules: list[dict[str, Any]]) -> None:
        self.loader, self.rules = loader, rules

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        patch(getattr(module, TARGET_CLASS), self.rules)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename ... (tracebacks, inspect)
        return getattr(self.loader, name)


def install_import_hook() -> bool:
    """Wrap the connector with the rules in RULES_ENV when its module is imported (at once if it is already);
    False, and nothing done, without the variable."""
    rules = rules_from_environment()
    if rules is None:
        return False
    if TARGET_MODULE in sys.modules:
        patch(getattr(sys.modules[TARGET_MODULE], TARGET_CLASS), rules)
    elif not any(isinstance(finder, _Hook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Hook(rules))
    return True


# ---------------------------------------------------------------------------------------------------------------
# The wrapped connector


@dataclass
class _Faults:
    """One connector's faults: its rules, what it learnt of the model, its swap halves."""

    rules: list[dict[str, Any]]
    held: dict[str, Any] = field(default_factory=dict)  # sample -> the first-finished transfer of a swap pair
    given: dict[str, Any] = field(default_factory=dict)  # request id -> rows (or an error) its next gather returns
    aux_ids: list[int] = field(default_factory=list)
    num_layers: int = 0
    norm: tuple[Any, float] | None = None  # (weight, eps), read when first needed


def patch(connector_class: type, rules: list[dict[str, Any]]) -> None:
    """Wrap `_gather` (the row faults) and `_send` (swap) of the connector class; once per class."""
    if getattr(connector_class, PATCHED_ATTR, None) is not None:
        return
    gather, send = connector_class._gather, connector_class._send  # type: ignore[attr-defined]

    @functools.wraps(gather)
    def _gather(self: Any, transfer: Any) -> Any:
        if transfer.request_id in _faults(self, rules).given:
            given = _faults(self, rules).given.pop(transfer.request_id)
            if isinstance(given, Exception):
                raise given
            return given
        return _row_faults(self, _faults(self, rules), transfer, gather(self, transfer))

    @functools.wraps(send)
    def _send(self: Any, transfer: Any) -> None:
        faults = _faults(self, rules)
        # A request run alone (the canary's rerun) has no batch to be mixed with: a swap is a batching bug.
        partner = None if transfer.canary else _partner(faults.rules, transfer.sample)
        if partner is None:
            return send(self, transfer)
        first = faults.held.pop(partner, None)
        if first is None:  # its blocks stay allocated (not reported done) until both are written
            faults.held[transfer.sample] = transfer
            return None
        try:
            mine, theirs = self._gather(first), self._gather(transfer)
            if mine.shape != theirs.shape:
                raise ValueError(f"swap fault: {first.sample} and {transfer.sample} have states of shapes "
                                 f"{tuple(mine.shape)} and {tuple(theirs.shape)}")
        except Exception as exc:  # the package's _send writes each one's .error file
            mine = theirs = exc
        faults.given[first.request_id], faults.given[transfer.request_id] = theirs, mine
        send(self, first)
        send(self, transfer)
        return None

    connector_class._gather = _gather  # type: ignore[attr-defined]
    connector_class._send = _send  # type: ignore[attr-defined]
    setattr(connector_class, PATCHED_ATTR, rules)
    log.warning("%s.%s wrapped with outside test faults: %s", TARGET_MODULE, TARGET_CLASS, json.dumps(rules))


def _faults(connector: Any, rules: list[dict[str, Any]]) -> _Faults:
    faults = connector.__dict__.get(_STATE_ATTR)
    if faults is None:
        faults = _Faults(rules)
        config = connector._vllm_config
        draft = config.speculative_config.draft_model_config.hf_config
        faults.aux_ids = sorted(set(draft.eagle_aux_hidden_state_layer_ids))
        faults.num_layers = int(config.model_config.hf_text_config.num_hidden_layers)
        connector.__dict__[_STATE_ATTR] = faults
    return faults


def _applies(rule: Mapping[str, Any], sample: str) -> bool:
    return "samples" not in rule or re.fullmatch(rule["samples"], sample) is not None


def _partner(rules: list[dict[str, Any]], sample: str) -> str | None:
    for rule in rules:
        if rule["kind"] == "swap" and _applies(rule, sample):
            for a, b in rule["pairs"]:
                if sample in (a, b):
                    return b if sample == a else a
    return None


def deepest_column(aux_ids: Sequence[int], num_layers: int) -> int:
    """The column `deepest_layer_offset` shifts: that of the highest aux id below N (aux N if it is the only one)."""
    below = [aux for aux in aux_ids if aux < num_layers]
    return list(aux_ids).index(max(below) if below else max(aux_ids))


def _row_faults(connector: Any, faults: _Faults, transfer: Any, states: Any) -> Any:
    for rule in faults.rules:
        kind = rule["kind"]
        if kind == "swap" or not _applies(rule, transfer.sample):
            continue
        states = states.clone()
        if kind == "deepest_layer_offset":
            column = deepest_column(faults.aux_ids, faults.num_layers)
            states[1:, column] = states[:-1, column].clone()
        elif kind == "last_layer_after_norm":
            if faults.num_layers not in faults.aux_ids:
                raise ValueError(f"last_layer_after_norm: aux id {faults.num_layers} (the last layer's output) is "
                                 f"not gathered (aux ids {faults.aux_ids})")
            column = faults.aux_ids.index(faults.num_layers)
            states[:, column] = _final_norm(connector, faults, states[:, column])
        elif kind == "slot_offset_after":
            position = int(rule["position"])
            if position < len(states) - 1:
                states[position:-1] = states[position + 1 :].clone()
    return states


def _final_norm(connector: Any, faults: _Faults, rows: Any) -> Any:
    """Llama's and Qwen's RMSNorm with the checkpoint's own weight and eps: in float32, then the weight times the
    result in the rows' dtype."""
    import torch

    if faults.norm is None:
        faults.norm = _norm_weight(Path(connector._vllm_config.model_config.model))
    weight, eps = faults.norm
    hidden = rows.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(device=rows.device, dtype=rows.dtype) * hidden.to(rows.dtype)


def _norm_weight(model_dir: Path) -> tuple[Any, float]:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    eps = float(config.get("text_config", config)["rms_norm_eps"])
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for key in NORM_WEIGHT_KEYS:
                if key in tensors.keys():
                    return tensors.get_tensor(key), eps
    raise ValueError(f"last_layer_after_norm: no final norm weight ({', '.join(NORM_WEIGHT_KEYS)}) in {model_dir}")
