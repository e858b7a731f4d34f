"""Real chat text for tests on a trained checkpoint: the sample job's conversations through the model's own chat
template, as token ids."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sharegpt_sample.jsonl"


def conversations(dataset: Path = SAMPLE) -> list[tuple[str, str]]:
    """(question, answer) of the dataset's single-turn conversations, in order."""
    found = []
    for line in dataset.read_text(encoding="utf-8").splitlines():
        turns = json.loads(line)["conversations"]
        human = [t["value"] for t in turns if t["from"] == "human"]
        gpt = [t["value"] for t in turns if t["from"] == "gpt"]
        if len(human) == 1 and len(gpt) == 1:
            found.append((human[0], gpt[0]))
    return found


def chat(tokenizer, question: str, answer: str, system: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) through the model's own chat template: the completion is the answer and the
    end-of-turn token."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    completion = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return prompt, completion
