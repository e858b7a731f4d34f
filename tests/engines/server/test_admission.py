"""Why a server may not serve the job: only what is true of it (a server asked under a name it does not serve says
nothing of its context, and is not said to be silent about it)."""

from __future__ import annotations

from dflash_queue.engines.config import SamplingConfig
from dflash_queue.engines.server.admission import ServedTarget, identity_problems
from dflash_queue.engines.server.protocols import ServedModel

TARGET = ServedTarget("tiny-qwen3", "unused", 1024)
GREEDY = SamplingConfig(temperature=0.0)


def test_a_server_of_another_name_is_refused_for_its_name_only():
    # vLLM's /v1/models gives max_model_len per served name: under the wrong one there is none to read.
    served = ServedModel(("tiny-qwen3",), None, [1, 2], seeded=True)
    typo = ServedTarget("tiny-qwen4", "unused", 1024)
    assert identity_problems(served, typo, [1, 2], GREEDY) == [
        "serves tiny-qwen3, not tiny-qwen4 (generate.server.model)"
    ]


def test_a_server_of_the_right_name_that_gives_no_context_or_a_short_one_is_refused_for_it():
    silent = ServedModel(("tiny-qwen3",), None, [1, 2], seeded=True)
    assert identity_problems(silent, TARGET, [1, 2], GREEDY) == [
        "does not say its context length (max_model_len from /v1/models or /tokenize)"
    ]
    short = ServedModel(("tiny-qwen3",), 512, [1, 2], seeded=True)
    assert identity_problems(short, TARGET, [1, 2], GREEDY)[0].startswith("its context is 512 tokens, shorter than")
    assert identity_problems(ServedModel(("tiny-qwen3",), 1024, [1, 2], seeded=True), TARGET, [1, 2], GREEDY) == []
