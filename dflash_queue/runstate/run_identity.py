"""What a run's output is made with, so that a run name or a storage location is never reused for another job.

The ledger in Redis says which shards of a run name are done, and storage holds what they produced. Both are
only true for the settings that made them: a rerun under the same `run.name` with another model would find every
shard "done" and send nothing, and a storage location written with other sampling would be taken as finished.
So the producer records, before it stages anything, the run's identity (the config's output settings, whose hash
is the fingerprint, and the storage location) in the broker and the settings in the storage root, and refuses to
go on when either was made with something else, saying what differs. Output that holds nothing made yet (prompt
shards staged by a run refused before it generated) is taken over instead, saying so (`takeover_note`).

The output settings hold the digest of the checkpoint's weights (`model.weights`) where the node has them; the
fingerprint leaves it out, since nodes without the weights take part in a run. So an identity is made otherwise
when its fingerprint differs, or its weights where both sides know theirs: a run recorded by a node without the
weights (or before the digest was recorded) is compared on the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from dflash_queue.errors import ConfigError

# In the storage root: the output settings of whatever wrote this location.
MANIFEST_KEY = "dflash-queue-run.json"
# How the sections of `Config.output_settings` are named in a config file.
SECTION_NAMES = {"sampling": "generate.sampling"}
# The weights' digest, which only a node holding the checkpoint knows (absent elsewhere).
WEIGHTS = "model.weights"


class OutputSettings(Protocol):
    """What a run's output is made with (the deployment's `Config` is one): its settings and their hash."""

    def fingerprint(self) -> str: ...

    def output_settings(self) -> dict[str, Any]: ...


class RunMismatch(ConfigError):
    """The broker's run or the storage location was made with other settings than this config's."""


@dataclass(frozen=True)
class RunIdentity:
    fingerprint: str
    settings: dict[str, Any]
    storage: str

    @classmethod
    def of(cls, config: OutputSettings, storage_url: str) -> RunIdentity:
        return cls(config.fingerprint(), config.output_settings(), storage_url)

    @property
    def model(self) -> str:
        return str(self.settings.get("model", {}).get("name", "?"))

    @property
    def weights(self) -> str | None:
        """The digest of the checkpoint's weights; None where they were not read (a node without them, or a
        record older than the digest)."""
        return self.settings.get("model", {}).get("weights")

    def made_otherwise(self, mine: RunIdentity) -> bool:
        """Whether output made with this identity is other than `mine`'s: another fingerprint, or other weights
        where both know theirs (the storage location aside)."""
        weights_known = self.weights is not None and mine.weights is not None
        return self.fingerprint != mine.fingerprint or (weights_known and self.weights != mine.weights)

    def to_json(self) -> str:
        return json.dumps(
            {"fingerprint": self.fingerprint, "settings": self.settings, "storage": self.storage}, sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> RunIdentity:
        data = json.loads(text)
        return cls(data["fingerprint"], data.get("settings", {}), data.get("storage", ""))

    def differences(self, mine: RunIdentity, *, storage: bool = True) -> list[str]:
        """`key: theirs; yours: mine` for every setting that differs (storage too, unless told not to)."""
        found = [
            f"{key}: {_show(theirs, key)}; yours: {_show(yours, key)}"
            for key, theirs, yours in _differing(_flatten(self.settings), _flatten(mine.settings))
        ]
        if not found and self.fingerprint != mine.fingerprint:
            found.append(f"fingerprint: {self.fingerprint}; yours: {mine.fingerprint}")
        if storage and self.storage != mine.storage:
            found.append(f"storage: {self.storage}; yours: {mine.storage}")
        return found


def broker_mismatch(run_name: str, recorded: RunIdentity, mine: RunIdentity) -> RunMismatch:
    return RunMismatch(
        f"this broker's run `{run_name}` was made with {_made_with(recorded, mine)}, yours with "
        f"{_made_with(mine, recorded)}: use another run.name, or --rebuild to start `{run_name}` over with your "
        f"config (its shard states and counters are reset; nothing in storage is deleted)."
        f"{_reextract_hint(recorded, mine)}\n"
        + "\n".join(f"  {line}" for line in recorded.differences(mine))
    )


def storage_mismatch(recorded: RunIdentity, mine: RunIdentity) -> RunMismatch:
    return RunMismatch(
        f"storage {mine.storage} holds output made with {_made_with(recorded, mine)}, not with yours "
        f"({_made_with(mine, recorded)}): its shards would be taken as done. Use another output location "
        f"(-o or storage.url), or the config that made it.{_reextract_hint(recorded, mine)}\n"
        + "\n".join(f"  {line}" for line in recorded.differences(mine, storage=False))
    )


def takeover_note(replaced: RunIdentity, mine: RunIdentity, run_name: str, *, broker: bool) -> str:
    """The one line that says output which stored nothing, made with `replaced`, is now `mine`'s (and `broker`: the
    broker's run `run_name` that staged it was started over)."""
    changes = [
        f"{key} {_show(old, key)} -> {_show(new, key)}"
        for key, old, new in _differing(_flatten(replaced.settings), _flatten(mine.settings))
    ]
    if replaced.storage != mine.storage:
        changes.append(f"storage {replaced.storage} -> {mine.storage}")
    what = ", ".join(changes) or f"fingerprint {replaced.fingerprint} -> {mine.fingerprint}"
    started_over = f"; the broker's run `{run_name}` that staged them started over" if broker else ""
    return (
        f"took over {mine.storage}: it held staged prompts only (no completion, no training shard), made with other "
        f"settings ({what}); recorded as yours now{started_over}"
    )


def _reextract_hint(recorded: RunIdentity, mine: RunIdentity) -> str:
    """When only extract settings differ, the command that reuses the job's stored completions."""
    differing = _differing(_flatten(recorded.settings), _flatten(mine.settings))
    if not differing or not all(key.startswith("extract.") for key, _, _ in differing):
        return ""
    return (
        " Only extract settings differ: `dflash-queue reextract -c YOUR_CONFIG --from THE_JOBS_CONFIG` extracts "
        "the job's stored completions again with yours, into another output, generating nothing again."
    )


def _made_with(identity: RunIdentity, other: RunIdentity) -> str:
    """The model, plus the first setting that tells the two apart when the model does not."""
    words = f"model {identity.model}"
    if identity.model == other.model:
        differing = _differing(_flatten(identity.settings), _flatten(other.settings))
        if differing and differing[0][0] != "model.name":
            key, value, _ = differing[0]
            words += f" and {key} = {_show(value, key)}"
        elif not differing and identity.storage != other.storage:
            words += f" into {identity.storage}"
    return words


def setting_differences(
    theirs: RunIdentity, yours: RunIdentity, *, besides: str = "", weights_known: bool = False, label: str = "yours"
) -> list[str]:
    """`key: theirs; LABEL: yours` for every output setting that differs, but those whose names start with `besides`
    (e.g. "extract."). `weights_known`: the weights differ also where only `theirs` knows them (output checked
    against a checkpoint that must be read now), not only where both do."""
    differing = _differing(_flatten(theirs.settings), _flatten(yours.settings), weights_known=weights_known)
    return [
        f"{key}: {_show(old, key)}; {label}: {_show(new, key)}"
        for key, old, new in differing
        if not (besides and key.startswith(besides))
    ]


def _differing(
    theirs: dict[str, Any], yours: dict[str, Any], *, weights_known: bool = False
) -> list[tuple[str, Any, Any]]:
    keys = sorted(set(theirs) | set(yours), key=lambda k: (k != "model.name", k))
    found = [(key, theirs.get(key), yours.get(key)) for key in keys if theirs.get(key) != yours.get(key)]
    if theirs.get(WEIGHTS) is None or (yours.get(WEIGHTS) is None and not weights_known):
        found = [item for item in found if item[0] != WEIGHTS]
    return found


def _flatten(settings: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, values in settings.items():
        name = SECTION_NAMES.get(section, section)
        if isinstance(values, dict):
            for key, value in values.items():
                flat[f"{name}.{key}"] = value
        else:
            flat[name] = values
    return flat


def _show(value: Any, key: str = "") -> str:
    if value is None:
        return "(no safetensors weights in model.path)" if key == WEIGHTS else "(unset)"
    return json.dumps(value)
