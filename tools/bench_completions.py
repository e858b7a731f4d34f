#!/usr/bin/env python
"""Completions shards: encode and decode with orjson against the standard library, side by side in one run.

Realistic shards: 256 samples of ~1,750 tokens (prompt + reply, ids drawn from a 150k vocabulary), the reply's
text (~4 characters a token, some of it non-ASCII), a quality verdict on each, and multi-turn records: a third
regenerate every assistant turn (earlier turns as spans of the prompt), a sixth also keep an earlier turn as
its own training sequence. Both codecs run the real `encode_completions` / `decode_completions`; rounds
alternate between them and the best round of each counts (the least disturbed by other work on the machine).

    .venv/bin/python tools/bench_completions.py [--samples 256] [--tokens 1750] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue import jsoncodec  # noqa: E402
from dflash_queue.quality.gate import Verdict  # noqa: E402
from dflash_queue.shards.completions import (  # noqa: E402
    CompletionRecord,
    ServedTurn,
    TurnSpan,
    decode_completions,
    encode_completions,
)

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


def best(times: list[float]) -> float:
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1750)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    records = make_records(args.samples, args.tokens)
    data = encode_completions(records)
    with jsoncodec.standard_library():
        stdlib_data = encode_completions(records)
        assert decode_completions(data, what="bench") == records
    assert decode_completions(stdlib_data, what="bench") == records
    tokens = sum(r.num_tokens for r in records)
    print(f"shard: {len(records)} records, {tokens:,} token ids, {len(data) / 1e6:.1f} MB as JSON lines "
          f"({len(stdlib_data) / 1e6:.1f} MB from the standard library)")

    timings: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for codec in ("stdlib", "orjson"):
            for step, run in (("encode", lambda: encode_completions(records)),
                              ("decode", lambda: decode_completions(data, what="bench"))):
                if codec == "stdlib":
                    with jsoncodec.standard_library():
                        started = time.process_time()
                        run()
                else:
                    started = time.process_time()
                    run()
                timings.setdefault((codec, step), []).append(time.process_time() - started)

    print(f"best of {args.rounds} alternating rounds, CPU time of this process:")
    print("| step | standard library | orjson | ratio |")
    print("| --- | --- | --- | --- |")
    for step in ("encode", "decode", "round trip"):
        if step == "round trip":
            old = best(timings["stdlib", "encode"]) + best(timings["stdlib", "decode"])
            new = best(timings["orjson", "encode"]) + best(timings["orjson", "decode"])
        else:
            old, new = best(timings["stdlib", step]), best(timings["orjson", step])
        print(f"| {step} | {old * 1e3:.1f} ms ({tokens / old / 1e6:.1f} M ids/s) | "
              f"{new * 1e3:.1f} ms ({tokens / new / 1e6:.1f} M ids/s) | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
