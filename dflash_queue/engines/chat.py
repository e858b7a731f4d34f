"""Prompt token ids from a conversation, through the target tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_queue.data.samples import Message


class ChatFormatter:
    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Message], *, enable_thinking: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_json() for m in messages],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )

    def prompt_ids(self, messages: Sequence[Message], *, enable_thinking: bool) -> list[int]:
        text = self.render(messages, enable_thinking=enable_thinking)
        # The template already wrote every special token; adding BOS/EOS again would change the prompt.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
