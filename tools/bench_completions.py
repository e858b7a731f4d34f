#!/usr/bin/env python
"""Completions shards: reading and writing as this version does, against token ids as JSON lists of ints
(through the standard library, as before orjson, and through orjson), side by side in one run.

Realistic shards: 256 samples of ~1,750 tokens (prompt + reply, ids drawn from a 150k vocabulary), the reply's
text (~4 characters a token, some of it non-ASCII), a quality verdict on each, and multi-turn records: a third
regenerate every assistant turn (earlier turns as spans of the prompt), a sixth also keep an earlier turn as
its own training sequence. Every way runs the real `encode_completions` / `decode_completions`; rounds
alternate between them and the best round of each counts (the least disturbed by other work on the machine).

    .venv/bin/python tools/bench_completions.py [--samples 256] [--tokens 1750] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
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


WAYS = {
    "lists, standard library": (True, True),
    "lists, orjson": (True, False),
    "base64 ids, orjson": (False, False),
}
BASELINE, CURRENT = "lists, standard library", "base64 ids, orjson"


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
    for way, (ids_as_lists, stdlib) in WAYS.items():
        with jsoncodec.standard_library() if stdlib else nullcontext():
            data[way] = encode_completions(records, ids_as_lists=ids_as_lists)
            assert decode_completions(data[way], what="bench") == records, way
    tokens = sum(r.num_tokens for r in records)
    sizes = ", ".join(f"{way} {len(blob) / 1e6:.1f} MB" for way, blob in data.items())
    print(f"shard: {len(records)} records, {tokens:,} token ids; as JSON lines: {sizes}")

    timings: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for way, (ids_as_lists, stdlib) in WAYS.items():
            write = timed(stdlib, lambda lists=ids_as_lists: encode_completions(records, ids_as_lists=lists))
            read = timed(stdlib, lambda blob=data[way]: decode_completions(blob, what="bench"))
            timings.setdefault((way, "write"), []).append(write)
            timings.setdefault((way, "read"), []).append(read)

    print(f"best of {args.rounds} alternating rounds, CPU time of this process:")
    print("| step | " + " | ".join(WAYS) + f" | {BASELINE} / {CURRENT} |")
    print("| --- " * (len(WAYS) + 2) + "|")
    for step in ("write", "read", "round trip"):
        best = {way: (min(timings[way, step]) if step != "round trip"
                      else min(timings[way, "write"]) + min(timings[way, "read"])) for way in WAYS}
        cells = " | ".join(f"{best[way] * 1e3:.1f} ms ({tokens / best[way] / 1e6:.1f} M ids/s)" for way in WAYS)
        print(f"| {step} | {cells} | {best[BASELINE] / best[CURRENT]:.2f}x |")


if __name__ == "__main__":
    main()
