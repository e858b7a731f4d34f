#!/usr/bin/env python
"""Completions shards: reading and writing as this version does, against token ids as JSON lists of ints
(through the standard library and through orjson) and against the codec before orjson and base64 ids (json,
`str.splitlines()`, `int()` on every id, as the shards' reader was when the ≥ 3x target was set; reproduced
below, since it is no longer in the package), side by side in one run.

Realistic shards: 256 samples of ~1,750 tokens (prompt + reply, ids drawn from a 150k vocabulary), the reply's
text (~4 characters a token, some of it non-ASCII), a quality verdict on each, and multi-turn records: a third
regenerate every assistant turn (earlier turns as spans of the prompt), a sixth also keep an earlier turn as
its own training sequence. Every way but the first runs the real `encode_completions` / `decode_completions`; rounds
alternate between them and the best round of each counts (the least disturbed by other work on the machine).

    .venv/bin/python tools/bench_completions.py [--samples 256] [--tokens 1750] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue import jsoncodec  # noqa: E402
from dflash_queue.shards.completions import (  # noqa: E402
    CompletionRecord,
    ServedTurn,
    TurnSpan,
    decode_completions,
    encode_completions,
)
from dflash_queue.shards.verdicts import Verdict  # noqa: E402

WORDS = ["the", "answer", "is", "because", "first", "we", "compute", "Schritt", "über", "résumé", "数据", "✓", "→"]


def make_records(samples: int, tokens: int, seed: int = 0) -> list[CompletionRecord]:
    rng = random.Random(seed)
    records = []
    for index in range(samples):
        total = max(8, int(rng.gauss(tokens, tokens / 4)))
        prompt_len = total // 3
        ids = [rng.randrange(150_000) for _ in range(total)]
        prompt, completion = ids[:prompt_len], ids[prompt_len:]
        turns: tuple[TurnSpan, ...] = ()
        served: tuple[ServedTurn, ...] = ()
        if index % 3 == 0:
            start = prompt_len // 3
            turns = (TurnSpan(start, start + prompt_len // 3, "stop"),)
        if index % 6 == 0:
            served = (ServedTurn(prompt[: prompt_len // 2], [rng.randrange(150_000) for _ in range(200)], "stop"),)
        text = " ".join(rng.choice(WORDS) for _ in range(len(completion)))
        quality = Verdict("keep", ("loop",) if index % 7 == 0 else (), (), rng.randrange(1, 400), "closed")
        records.append(CompletionRecord(
            hashlib.sha256(b"%d" % index).hexdigest()[:32], prompt, completion, "stop", index % 2 == 0, text, f"data.jsonl:{index + 1}", turns,
            quality, served,
        ))
    return records


def encode_before(records: list[CompletionRecord]) -> bytes:
    """The writer before orjson: json.dumps per row, ids as lists."""
    rows = (r.to_json(ids_as_lists=True) for r in records)
    return "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows).encode()


def decode_before(data: bytes) -> list[CompletionRecord]:
    """The reader before orjson: the text split into lines, json.loads per line, int() per token id."""
    records = []
    for line in data.decode("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        records.append(CompletionRecord(
            id=row["id"],
            prompt_ids=[int(t) for t in row["prompt_ids"]],
            completion_ids=[int(t) for t in row["completion_ids"]],
            finish_reason=row["finish_reason"],
            thinking=bool(row["thinking"]),
            text=row.get("text", ""),
            source=row.get("source", ""),
            earlier_turns=tuple(TurnSpan.from_json(t) for t in row.get("turns", ())),
            quality=Verdict.from_json(row["quality"]) if row.get("quality") is not None else None,
            served_turns=tuple(
                ServedTurn([int(t) for t in s["prompt_ids"]], [int(t) for t in s["completion_ids"]],
                           str(s["finish_reason"]))
                for s in row.get("served_turns", ())
            ),
        ))
    return records


def codec(ids_as_lists: bool):
    return (lambda records: encode_completions(records, ids_as_lists=ids_as_lists),
            lambda data: decode_completions(data, what="bench"))


# way: (encode, decode, through the standard library alone)
WAYS = {
    "before orjson": (encode_before, decode_before, True),
    "lists, standard library": (*codec(True), True),
    "lists, orjson": (*codec(True), False),
    "base64 ids, orjson": (*codec(False), False),
}
BASELINE, CURRENT = "before orjson", "base64 ids, orjson"


def timed(stdlib: bool, run) -> float:
    with jsoncodec.standard_library() if stdlib else nullcontext():
        started = time.process_time()
        run()
        return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1750)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    records = make_records(args.samples, args.tokens)
    data: dict[str, bytes] = {}
    for way, (encode, decode, stdlib) in WAYS.items():
        with jsoncodec.standard_library() if stdlib else nullcontext():
            data[way] = encode(records)
            assert decode(data[way]) == records, way
    tokens = sum(r.num_tokens for r in records)
    sizes = ", ".join(f"{way} {len(blob) / 1e6:.1f} MB" for way, blob in data.items())
    print(f"shard: {len(records)} records, {tokens:,} token ids; as JSON lines: {sizes}")

    timings: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for way, (encode, decode, stdlib) in WAYS.items():
            write = timed(stdlib, lambda encode=encode: encode(records))
            read = timed(stdlib, lambda blob=data[way], decode=decode: decode(blob))
            timings.setdefault((way, "write"), []).append(write)
            timings.setdefault((way, "read"), []).append(read)

    print(f"best of {args.rounds} alternating rounds, CPU time of this process:")
    print("| step | " + " | ".join(WAYS) + f" | {BASELINE} / {CURRENT} (target ≥ 3) |")
    print("| --- " * (len(WAYS) + 2) + "|")
    for step in ("write", "read", "round trip"):
        best = {way: (min(timings[way, step]) if step != "round trip"
                      else min(timings[way, "write"]) + min(timings[way, "read"])) for way in WAYS}
        cells = " | ".join(f"{best[way] * 1e3:.1f} ms ({tokens / best[way] / 1e6:.1f} M ids/s)" for way in WAYS)
        print(f"| {step} | {cells} | {best[BASELINE] / best[CURRENT]:.2f}x |")


if __name__ == "__main__":
    main()
