"""`verify`: every staged sample found exactly once among shards, quality-gate drops and dead letters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_queue.cli import main
from dflash_queue.deadletters import SAMPLE, TASK, DeadLetter, DeadLetters, record_id
from dflash_queue.errors import ShardFormatError
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.shards.keys import prompts_key, shard_key
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.shards.training import ExtractedSample, ShardInfo
from dflash_queue.shards.training_writer import write_training_shard
from dflash_queue.shards.verdicts import Verdict
from dflash_queue.storage import LocalStorage, open_storage
from dflash_queue.verify import shard_contents

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "examples" / "sharegpt_sample.jsonl"
INFO = ShardInfo("tiny", (1, 2), 4, 8, "float32", "fp", {})


def extracted(sample_id: str, flagged: bool) -> ExtractedSample:
    return ExtractedSample(
        id=sample_id,
        input_ids=torch.arange(5, dtype=torch.int32),
        loss_mask=torch.tensor([0, 0, 1, 1, 1], dtype=torch.uint8),
        hidden_states=torch.randn(5, 2, 8),
        finish_reason="stop",
        thinking=False,
        quality=Verdict(flags=("repetition",)) if flagged else None,
    )


def store_shard(storage, shard_id: str, ids: list[str], *, dropped=(), dead=()) -> None:
    path = storage.root / "tmp.safetensors"
    samples = [extracted(i, flagged=n == 0) for n, i in enumerate(ids)]  # the first of each flagged
    write_training_shard(path, samples, INFO, dropped=[(i, Verdict()) for i in dropped], dead=dead)
    storage.write_file(shard_key(shard_id), path)
    path.unlink()


def test_verify_finds_missing_duplicated_and_accounts_for_the_rest(make_config, redis_url, tmp_path):
    config = make_config(dataset={"shard_size": 4, "thinking": "never"})
    dataset = tmp_path / "prompts.jsonl"
    lines = SAMPLE_DATA.read_text().splitlines()[:12]
    dataset.write_text("\n".join([*lines, lines[0], "{not json"]) + "\n")  # one duplicate, one bad record
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=lambda *args: None)
    storage = open_storage(config.storage)
    shards = [[s.id for s in decode_prompts(storage.read_bytes(prompts_key(i)), what=i)] for i in report.shard_ids]
    assert [len(s) for s in shards] == [4, 4, 4]
    first, second, third = report.shard_ids
    dead = DeadLetters.from_url(redis_url, config.run.name)

    # Shard 1 whole; shard 2: two samples, one dropped by the gate, one dead-lettered as poison;
    # shard 3 failed as a task.
    store_shard(storage, first, shards[0])
    store_shard(storage, second, shards[1][:2], dropped=[shards[1][2]], dead=[shards[1][3]])
    dead.add(DeadLetter(record_id(SAMPLE, "extract", second, [shards[1][3]]), SAMPLE, "extract", "dfq.extract",
                        second, sample_ids=[shards[1][3]], exc_type="InjectedFault"))
    dead.add(DeadLetter(record_id(TASK, "generate", third), TASK, "generate", "dfq.generate", third))

    result = CliRunner().invoke(main, ["verify", str(dataset), "-c", config.source])
    assert result.exit_code == 0, result.output
    assert "staged samples: 12" in result.output
    assert "done: 6 (of which flagged by the quality gate: 2)" in result.output
    assert "dropped by the quality gate: 1" in result.output and "dead letters: 5" in result.output
    assert "1 exact duplicates" in result.output and "1 bad records" in result.output

    # A sample lost (the shard-3 dead letter purged) and one written twice (into shard 1 again).
    dead.remove([record_id(TASK, "generate", third)])
    store_shard(storage, first, shards[0] + [shards[1][0]])
    result = CliRunner().invoke(main, ["verify", str(dataset), "-c", config.source])
    assert result.exit_code == 1
    assert "missing: 4" in result.output and "duplicated: 1" in result.output
    assert f"missing {shards[2][0]}: shard {third} (queued; no message for it in the broker: `dflash-queue enqueue " \
        "--rebuild` sends it again)" in result.output
    places = ", ".join(sorted(f"shards/{i}.safetensors" for i in (first, second)))
    assert f"duplicated {shards[1][0]}: {places}" in result.output


def test_a_shard_is_read_through_the_strict_reader(tmp_path):
    """Ids, flagged rows and drops come from a header the shards' one reader checked: offsets that do not cover
    the tokens make the shard unreadable, although its header names its samples."""
    storage = LocalStorage(tmp_path)
    store_shard(storage, "s1", ["a", "b"], dropped=["c"])
    ids, flagged, dropped = shard_contents(storage, shard_key("s1"))
    assert sorted(ids) == ["a", "b"] and flagged == [0] and dropped == ["c"]
    path = storage.path_of(shard_key("s1"))
    values = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    values["offsets"] = torch.tensor([0, 5, 9])
    save_file(values, str(path), metadata=metadata)
    with pytest.raises(ShardFormatError, match="offsets must run from 0 to 10 tokens"):
        shard_contents(storage, shard_key("s1"))


def test_verify_accounts_by_sample_whatever_the_order_or_subset_of_the_files(make_config, redis_url, tmp_path):
    config = make_config(dataset={"shard_size": 4, "thinking": "never"})
    lines = SAMPLE_DATA.read_text().splitlines()
    first, second, extra = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    first.write_text("\n".join(lines[:6]) + "\n")  # shards of 4 straddle the two files
    second.write_text("\n".join(lines[6:12]) + "\n")
    extra.write_text("\n".join(lines[12:15]) + "\n")
    report = Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([first, second],
                                                                                    send=lambda *args: None)
    storage = open_storage(config.storage)
    for shard_id in report.shard_ids:
        store_shard(storage, shard_id, [s.id for s in decode_prompts(storage.read_bytes(prompts_key(shard_id)),
                                                                     what=shard_id)])

    def verify(*files: Path):
        return CliRunner().invoke(main, ["verify", *map(str, files), "-c", config.source])

    assert verify(first, second).exit_code == 0
    reordered = verify(second, first)
    assert reordered.exit_code == 0 and "done: 12" in reordered.output and "missing: 0" in reordered.output
    assert "note: the files as given make 3 of 3 shards that were never enqueued" in reordered.output
    subset = verify(second)
    assert subset.exit_code == 0 and "staged samples: 6" in subset.output and "done: 6" in subset.output
    extended = verify(first, second, extra)
    assert extended.exit_code == 1 and "missing: 3" in extended.output
    extra_ids = [line for line in extended.output.splitlines() if line.startswith("missing ")]
    assert len(extra_ids) == 3 and all(line.endswith(": not enqueued") for line in extra_ids)


def test_samples_of_suspect_shards_are_not_done_and_each_suspect_is_named(make_config, redis_url, tmp_path):
    from dflash_queue.runstate.audits import AuditRecords
    from dflash_queue.shards.suspects import SuspectMark, clear_mark, mark_suspect

    config = make_config(dataset={"shard_size": 4, "thinking": "never"})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE_DATA.read_text().splitlines()[:12]) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=lambda *args: None)
    storage = open_storage(config.storage)
    for shard_id in report.shard_ids:
        store_shard(storage, shard_id, [s.id for s in decode_prompts(storage.read_bytes(prompts_key(shard_id)),
                                                                     what=shard_id)])
    first, second, third = report.shard_ids
    # The first: an audit of its worker failed (the broker's record and the mark), after a trainer had consumed it.
    # The second: marked in storage only. The third: good.
    audits = AuditRecords(ledger.client, config.run.name)
    audits.record_stored(first, 0, "inc-a", "extract@node-a", every_shards=10, every_s=0.0)
    [made] = audits.record_failed(audits.stored_shard(first, 0), "layer 2: worst token 1.3e+00")
    audits.note_consumed(made, ["trainer"])
    mark_suspect(storage, SuspectMark(first, 0, made.reason, first, "extract@node-a"))
    mark_suspect(storage, SuspectMark(second, 0, "its worker had stopped", "", "extract@node-b"))

    result = CliRunner().invoke(main, ["verify", str(dataset), "-c", config.source])
    assert result.exit_code == 1, result.output
    assert "done: 4 (" in result.output and "suspect (stored, not done until extracted again): 8" in result.output
    assert "missing: 0" in result.output and "duplicated: 0" in result.output
    assert f"suspect shard {first}: stored by extract@node-a; the audit of shard {first} failed: layer 2: worst " \
        "token 1.3e+00" in result.output
    assert f"suspect shard {second}: stored by extract@node-b; its worker had been halted by an audit: its worker " \
        "had stopped (marked in storage only" in result.output
    assert f"consumed before it turned suspect: {first} by trainer" in result.output
    assert "2 suspect shard(s) (1 consumed before they turned suspect): `dflash-queue suspects reextract" in \
        result.output

    # Stored anew (the extract lane clears both marks): done.
    audits.clear_suspect(first, 0)
    for shard_id in (first, second):
        clear_mark(storage, shard_id, 0)
    result = CliRunner().invoke(main, ["verify", str(dataset), "-c", config.source])
    assert result.exit_code == 0 and "done: 12 (" in result.output and "suspect" not in result.output, result.output
