"""A job's stored completions extracted again with other extract settings (layers, `last_layer_state`, the
states' dtype, the extract engine), into a new output, with nothing generated again (`dflash-queue reextract`).

The new job is the old one in everything that made its completions (model, dataset, sampling, quality gate,
generate engine arguments): only `extract` settings may differ, and its fingerprint is its own. Each completed
shard's prompts and completions are copied, byte for byte, into the new output, its state set to generated, and
an extract task sent for it: the extract lane reads them there as it would after generation. A shard the old job
had not generated is left out and reported. Shards already stored in the new output are done.
"""

from __future__ import annotations

from collections.abc import Callable

from dflash_queue.config import Config
from dflash_queue.errors import ConfigError
from dflash_queue.prompt_staging import EnqueueReport
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.shard_states import DONE, GENERATED
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import COMPLETIONS, completions_key, prompts_key, shard_id_of, stored_shard_ids
from dflash_queue.storage import Storage, open_storage

# send(shard id, samples, fingerprint): an extract task.
SendExtract = Callable[[str, int, str], None]

# Output settings that may differ between a job and its re-extraction: what the extract lane alone makes.
EXTRACT_SETTINGS = ("extract", "extract.vllm.engine_args")


def generation_differences(old: Config, new: Config) -> list[str]:
    """The output settings, other than extract's, in which `new` differs from `old` (section names). Whole
    Configs: their output settings span every section."""
    mine, theirs = new.output_settings(), old.output_settings()
    return sorted(k for k in set(mine) | set(theirs) if k not in EXTRACT_SETTINGS and mine.get(k) != theirs.get(k))


def check_reextraction(old: Config, new: Config) -> None:
    """ConfigError unless `new` re-extracts `old`: the same completions, another output."""
    differing = generation_differences(old, new)
    if differing:
        raise ConfigError(
            f"{new.source}: differs from {old.source} in {', '.join(differing)}: its completions would be other "
            "ones; only extract settings may differ in a re-extraction (run the job instead)"
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
    check_reextraction(old, new)
    send = send or _send_extract
    source = open_storage(old.storage)
    report = EnqueueReport()
    done = stored_shard_ids(storage)
    fingerprint = new.fingerprint()
    shard_ids = sorted({shard_id_of(key) for key in source.list(f"{COMPLETIONS}/") if key.endswith(".jsonl")})
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


def _send_extract(shard_id: str, num_samples: int, fingerprint: str) -> None:
    from dflash_queue.lanes.registry import FINAL_LANE
    from dflash_queue.queue.tasks import send_to_lane

    send_to_lane(FINAL_LANE.name, shard_id, num_samples, fingerprint)
