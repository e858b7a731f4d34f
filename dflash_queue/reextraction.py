"""A job's stored completions extracted again with other extract settings (layers, `last_layer_state`, the
states' dtype, the extract engine), into a new output, with nothing generated again (`dflash-queue reextract`).

The new job is the old one in everything that made its completions (model and its weights, dataset, sampling,
quality gate, generate engine arguments): only `extract` settings may differ, and its fingerprint is its own. What
made the completions is read from the old output's run identity (`dflash-queue-run.json`, runstate/run_identity.py),
not taken from the old config as it reads now: the old config is checked against it first, so one edited since
(other sampling, another checkpoint behind the same model.path: its weights' digest) is refused, naming what differs.
Each completed shard's prompts and completions are copied, byte for byte, into the new output, its state set to
generated, and an extract task sent for it: the extract lane reads them there as it would after generation. A
shard the old job had not generated is left out and reported. Shards already stored in the new output are done.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.errors import ConfigError
from dflash_queue.prompt_staging import EnqueueReport
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.run_identity import MANIFEST_KEY, WEIGHTS, RunIdentity, setting_differences
from dflash_queue.runstate.shard_states import DONE, GENERATED
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completed_shard_ids, completions_key, prompts_key, stored_shard_ids
from dflash_queue.storage import Storage, open_storage

# send(shard id, samples, fingerprint): an extract task.
SendExtract = Callable[[str, int, str], None]

# Output settings that may differ between a job and its re-extraction (their names start so): what the extract
# lane alone makes (its layers, states and dtype, and the extract engine's arguments).
EXTRACT_SETTINGS = "extract."


def generation_differences(old: Config, new: Config) -> list[str]:
    """`name: old's; yours: new's` for each output setting, other than extract's, in which `new` differs from `old`;
    the weights too where only old's are known. Whole Configs: their output settings span every section."""
    return setting_differences(_identity(old), _identity(new), besides=EXTRACT_SETTINGS, weights_known=True)


def check_reextraction(old: Config, new: Config, source: Storage | None = None) -> None:
    """ConfigError unless `new` re-extracts the output of `old`: `old` still reads as what made it
    (`check_made_with`), and `new` makes the same completions into another output (`check_configs`)."""
    check_made_with(old, source)
    check_configs(old, new)


def check_made_with(old: Config, source: Storage | None = None) -> None:
    """ConfigError unless the old job's output (`source`, else its storage.url) records what it was made with and
    `old` as it reads now agrees with it in every setting but extract's: the checkpoint's weights included wherever
    the record has their digest (a record written by a node without the weights, or before the digest, is compared
    on the rest), and in its fingerprint where no setting differs."""
    source = source or open_storage(old.storage)
    if not source.exists(MANIFEST_KEY):
        if not _completed_shards(source):
            raise ConfigError(f"{old.source}: {old.storage.url} holds no completions: run that job first")
        raise ConfigError(
            f"{old.source}: {old.storage.url} holds completions but no {MANIFEST_KEY} (what the run that wrote them "
            "was made with): nothing tells whether this config, as it reads now, made them; they are not extracted "
            "again (run the job anew into another output)"
        )
    try:
        stored = RunIdentity.from_json(source.read_bytes(MANIFEST_KEY))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{old.storage.url}: unreadable {MANIFEST_KEY} ({type(exc).__name__}: {exc})") from None
    now = _identity(old)
    every = setting_differences(stored, now, weights_known=True, label="now")
    differing = [line for line in every if not line.startswith(EXTRACT_SETTINGS)]
    if not every and stored.fingerprint != now.fingerprint:
        # The same settings hashed otherwise: output_settings has changed in a way the record cannot show.
        differing = [f"fingerprint: {stored.fingerprint}; now: {now.fingerprint}"]
    if differing:
        names = [line.partition(":")[0] for line in differing]
        other_weights = (
            f" (its model.path, {old.model.path}, holds another checkpoint than the one that made them)"
            if WEIGHTS in names else ""
        )
        raise ConfigError(
            f"{old.source}: reads otherwise than when it made {old.storage.url} (its {MANIFEST_KEY}): the "
            f"completions there were made with other {', '.join(names)}{other_weights}; extracting them with this "
            "config as it reads now would record states of other settings. Point --from at the config (and "
            "checkpoint) that made them, or run the job anew into another output.\n"
            + "\n".join(f"  {line}" for line in differing)
        )


def check_configs(old: Config, new: Config) -> None:
    """ConfigError unless `new` differs from `old` in extract settings only, and writes another output under another
    run name."""
    differing = generation_differences(old, new)
    if differing:
        raise ConfigError(
            f"{new.source}: differs from {old.source} in {', '.join(line.partition(':')[0] for line in differing)}: "
            "its completions would be other ones; only extract settings may differ in a re-extraction (run the job "
            "instead)\n" + "\n".join(f"  {line}" for line in differing)
        )
    if new.storage.url.rstrip("/") == old.storage.url.rstrip("/"):
        raise ConfigError(
            f"{new.source}: storage.url is {old.source}'s ({old.storage.url}): a re-extraction writes a new output; "
            "set another storage.url (or -o)"
        )
    if new.run.name == old.run.name:
        raise ConfigError(
            f"{new.source}: run.name is {old.source}'s ({old.run.name!r}): the re-extraction is a job of its own in "
            "the broker; give it another run.name"
        )
    if Path(new.run.state_dir).resolve() == Path(old.run.state_dir).resolve():
        raise ConfigError(
            f"{new.source}: run.state_dir is {old.source}'s ({old.run.state_dir}): the re-extraction runs as a job of "
            "its own (its lock, logs and private broker live there); give it another run.state_dir"
        )
    if new.fingerprint() == old.fingerprint():
        raise ConfigError(f"{new.source}: its extract settings are {old.source}'s: nothing to extract again")


def stage_reextraction(
    old: Config,
    new: Config,
    ledger: Ledger,
    storage: Storage,
    *,
    send: SendExtract | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> EnqueueReport:
    """Copy the old job's completed shards into `storage` (the new output) and send each not yet stored there to
    the extract lane. The report counts samples and shards as `enqueue`'s does. Whole Configs: the two are
    compared in all their output settings (`check_reextraction`)."""
    source = open_storage(old.storage)
    check_reextraction(old, new, source)
    send = send or _send_extract
    report = EnqueueReport()
    done = stored_shard_ids(storage)
    fingerprint = new.fingerprint()
    shard_ids = _completed_shards(source)
    if not shard_ids:
        raise ConfigError(f"{old.source}: {old.storage.url} holds no completions: run that job first")
    to_send: dict[str, int] = {}
    for shard_id in shard_ids:
        completions = source.read_bytes(completions_key(shard_id))
        records = decode_completions(completions, what=completions_key(shard_id))
        kept = sum(record.kept for record in records)
        report.shards += 1
        report.samples += len(records)
        report.staged += len(records)
        report.shard_ids.append(shard_id)
        report.shard_samples[shard_id] = kept
        if shard_id in done:
            report.skipped_done += 1
            ledger.set_state(shard_id, DONE, num_samples=kept)  # storage decides what is done
        else:
            storage.write_bytes(prompts_key(shard_id), source.read_bytes(prompts_key(shard_id)))
            storage.write_bytes(completions_key(shard_id), completions)
            to_send[shard_id] = kept
        if on_shard:
            on_shard(len(records))
    ShardWindow(ledger.client, new.run.name).seal_epoch(0, report.shard_samples)
    for shard_id, kept in to_send.items():
        ledger.set_state(shard_id, GENERATED, num_samples=kept)
        send(shard_id, kept, fingerprint)
        report.enqueued += 1
        report.pending_samples += kept
    return report


def _completed_shards(source: Storage) -> list[str]:
    return completed_shard_ids(source)


def _identity(config: Config) -> RunIdentity:
    return RunIdentity.of(config, config.storage.url)


def _send_extract(shard_id: str, num_samples: int, fingerprint: str) -> None:
    from dflash_queue.lanes.registry import FINAL_LANE
    from dflash_queue.queue.tasks import send_to_lane

    send_to_lane(FINAL_LANE.name, shard_id, num_samples, fingerprint)
