#!/usr/bin/env python
"""Generation tokens/s on vLLM with and without speculative decoding, on a random-weight checkpoint.

With random weights a drafter's acceptance says nothing about a real target (an MTP head of random weights
accepts by chance, and a random checkpoint has no trained MTP layers at all), so what is measured is what does not
depend on trained weights:

  (a) n-gram drafting on prompts of distinct random tokens, where the prompt offers no match: the overhead of
      speculative decoding when drafts are few or rejected (unless the random model repeats itself, which the
      printed acceptance shows: a tiny random model does, and then accepts nearly every draft);
  (b) n-gram drafting on repetitive prompts (a block of tokens repeated), where drafts are proposed at every step.

Each engine (plain, n-gram) is started once and warmed up; the same greedy requests are timed on each. Printed per
prompt set: output tokens/s plain and n-gram, their ratio, and the acceptance vLLM counted (accepted / drafted
tokens), so that a ratio is read with the acceptance it came with. Greedy replies are compared too (they must be
the same tokens). Then seeded sampling with n-gram drafting: two fresh engines, the second given every other prompt
in reverse order, must give each prompt the same sampled reply (what a shard requeued to another worker relies on;
vLLM's CPU build does not: its rejection sampler leaves drafted positions' temperature, top_p and top_k unset).

    python tools/bench_speculative.py --model DIR [--device cuda] [--prompts 256] [--max-tokens 256] [--k 3]
"""

from __future__ import annotations

import argparse
import random
import time


def spec_counts(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    return {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter) and "spec_decode" in m.name}


def prompt_sets(vocab: int, count: int, length: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    distinct = [rng.sample(range(10, vocab), length) for _ in range(count)]
    repetitive = []
    for _ in range(count):
        block = [rng.randrange(10, vocab) for _ in range(16)]
        repetitive.append((block * (length // 16 + 1))[:length])
    return {"distinct prompts": distinct, "repetitive prompts": repetitive}


def engine(args: argparse.Namespace, speculative: dict | None, **extra):
    from vllm import LLM

    return LLM(
        model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 8, enforce_eager=
        args.device == "cpu", speculative_config=speculative, seed=0,
        **({"kv_cache_memory_bytes": 2**30, "enable_chunked_prefill": False} if args.device == "cpu" else {}), **extra,
    )


def run(args: argparse.Namespace, speculative: dict | None, sets: dict[str, list[list[int]]]) -> dict[str, tuple]:
    from vllm import SamplingParams, TokensPrompt

    llm = engine(args, speculative, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    try:
        warm = [TokensPrompt(prompt_token_ids=ids) for ids in next(iter(sets.values()))[:4]]
        llm.generate(warm, params, use_tqdm=False)
        for name, prompts in sets.items():
            before = spec_counts(llm)
            start = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = spec_counts(llm)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            drafted = after.get("vllm:spec_decode_num_draft_tokens", 0) - before.get("vllm:spec_decode_num_draft_tokens", 0)
            accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
                "vllm:spec_decode_num_accepted_tokens", 0)
            replies = [list(o.outputs[0].token_ids) for o in outputs]
            results[name] = (tokens / seconds, drafted, accepted, replies)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results


def seeded_replies(args: argparse.Namespace, speculative: dict, prompts: list[list[int]], order: list[int]) -> dict:
    """Sampled replies (a seed per prompt, as the generate lane gives each sample) of a fresh engine, for the prompts
    `order` names, in that order and batch: {prompt index: tokens}."""
    from vllm import SamplingParams, TokensPrompt

    llm = engine(args, speculative)
    try:
        params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=args.max_tokens,
                                 ignore_eos=True) for i in order]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in order], params, use_tqdm=False)
        return {i: list(o.outputs[0].token_ids) for i, o in zip(order, outputs, strict=True)}
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--no-seeded", action="store_true", help="skip the seeded-sampling check (two more engines)")
    args = parser.parse_args()

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    vocab = int(config.get_text_config().vocab_size)
    sets = prompt_sets(vocab, args.prompts, args.prompt_len)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = run(args, None, sets)
    speculative = run(args, ngram, sets)
    print(f"speculative decoding, {args.model} ({args.device}, {args.dtype}), {args.prompts} prompts of "
          f"{args.prompt_len} tokens, {args.max_tokens} greedy tokens each, n-gram k={args.k}; MTP not measured: "
          "random weights have no trained MTP head, its acceptance would mean nothing")
    for name in sets:
        base, _, _, base_replies = plain[name]
        rate, drafted, accepted, replies = speculative[name]
        acceptance = accepted / drafted if drafted else 0.0
        same = sum(a == b for a, b in zip(base_replies, replies))
        print(f"  {name}: plain {base:,.0f} tok/s, n-gram {rate:,.0f} tok/s, ratio {rate / base:.2f}; "
              f"acceptance {acceptance:.1%} ({accepted:,.0f} of {drafted:,.0f} drafted tokens); "
              f"greedy replies identical {same}/{len(replies)}")
    if not args.no_seeded:
        # Seeded sampling with drafting: a restarted engine, another batch (every other prompt, in reverse order)
        # must give each prompt the same reply, as a requeued shard's samples get on another worker.
        prompts = sets["repetitive prompts"]
        what = "seeded sampling with n-gram drafting (temperature 0.8, top_p 0.95, top_k 50)"
        try:
            first = seeded_replies(args, ngram, prompts, list(range(len(prompts))))
            again = seeded_replies(args, ngram, prompts, list(range(len(prompts)))[::-2])
        except Exception as exc:  # vLLM's CPU build: its rejection sampler indexes past the vocabulary
            print(f"  {what}: the engine failed: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            same = sum(first[i] == again[i] for i in again)
            print(f"  {what}: replies identical across an engine restart and another batch {same}/{len(again)}")


if __name__ == "__main__":
    main()
