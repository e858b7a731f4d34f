"""Prompt token ids from a conversation, through the target tokenizer's own chat template.

Besides whole prompts, the formatter knows two pieces of template output that token-level work needs:
  * the generation prompt (`<|im_start|>assistant\\n`, plus an empty think block when thinking is off), which
    opens the assistant turn being generated and so belongs to it when a turn is judged;
  * the continuation after a generated turn: the end-of-turn text (when the engine stopped without writing
    it), the next user/tool turns and the next generation prompt. Appending it to the exact generated ids
    conditions the next turn on exactly those ids, never on a re-tokenised copy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from dflash_queue.data.samples import Message

# Text that cannot occur in a conversation, used to find what a template writes around a turn.
_SENTINEL_USER = "\u2063dfq-user\u2063"
_SENTINEL_REPLY = "\u2063dfq-reply\u2063"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = (Message("user", "What is 2 + 2?"),)


@dataclass(frozen=True)
class ThinkingPolicyCheck:
    ok: bool
    message: str


class ChatFormatter:
    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._continuations = lru_cache(maxsize=4096)(self._continuation_text)
        self._generation_prompts: dict[bool, tuple[int, ...]] = {}
        self._special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
            getattr(tokenizer, "added_tokens_decoder", None) or {}
        )

    def render(self, messages: Sequence[Message], *, enable_thinking: bool, tools: str | None = None) -> str:
        """The prompt text: the conversation with the template's generation prompt; `tools` (canonical JSON
        list of schemas) go to the template, which renders its tools block."""
        return self.tokenizer.apply_chat_template(
            [m.to_json() for m in messages],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            tools=_tool_list(tools),
        )

    def render_batch(
        self, conversations: Sequence[Sequence[Message]], *, enable_thinking: bool, tools: str | None = None
    ) -> list[str]:
        """Like `render` for many conversations with the same tools in one call (the template is compiled once)."""
        if not conversations:
            return []
        return self.tokenizer.apply_chat_template(
            [[m.to_json() for m in messages] for messages in conversations],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            tools=_tool_list(tools),
        )

    def effective_thinking(self, requested: bool) -> bool:
        """Whether a turn generated with `enable_thinking = requested` starts with thinking on, as the template
        decides: a generation prompt that opens `<think>` (thinking-first templates) thinks, one that writes a
        closed empty block does not, and one that writes neither leaves it to the request."""
        opening = self.tokenizer.decode(list(self._generation_prompt(requested)), skip_special_tokens=False)
        if THINK_OPEN not in opening and THINK_CLOSE not in opening:
            return requested
        return ends_inside_thinking(opening)

    def check_thinking_policy(self, policy: str) -> ThinkingPolicyCheck:
        """Whether the template can do what `dataset.thinking = policy` asks: render one prompt with
        enable_thinking False and True and compare.

        Different renderings: the template has a switch, every policy works. The same rendering: the template
        either always opens a thinking block (a thinking-only model; `never` cannot be honoured) or ignores the
        flag and never thinks (`always`/`auto` cannot be honoured).
        """
        try:
            off = self.render(_PROBE, enable_thinking=False)
            on = self.render(_PROBE, enable_thinking=True)
        except Exception as exc:
            return ThinkingPolicyCheck(
                False, f"the template does not render a one-turn prompt: {type(exc).__name__}: {exc}"
            )
        if off != on:
            return ThinkingPolicyCheck(True, f"enable_thinking switches thinking; policy {policy!r} can be honoured")
        if THINK_OPEN in on[on.rfind(_PROBE[-1].content) :]:
            if policy == "never":
                return ThinkingPolicyCheck(
                    False, "the template always opens <think>: dataset.thinking = 'never' cannot be honoured"
                )
            return ThinkingPolicyCheck(True, f"the template always thinks; policy {policy!r} is satisfied")
        if policy == "never":
            return ThinkingPolicyCheck(True, "the template has no thinking mode; policy 'never' is satisfied")
        return ThinkingPolicyCheck(
            False,
            f"the template ignores enable_thinking and never opens <think>: dataset.thinking = {policy!r} needs a "
            "template with a thinking mode",
        )

    def require_thinking_policy(self, policy: str, source: str) -> None:
        """ConfigError (with the message `doctor` gives) when the template cannot honour the policy."""
        from dflash_queue.errors import ConfigError

        check = self.check_thinking_policy(policy)
        if not check.ok:
            raise ConfigError(f"{source}: invalid configuration\n  dataset.thinking: {check.message}")

    def reply_message(self, ids: Sequence[int], start: int, end: int) -> Message:
        """The assistant message of the generated ids[start:end], as a client would send it back: the answer as
        `content`, the reasoning (split at `</think>`, also when the prompt opened the block) as `reasoning`."""
        before = self.tokenizer.decode(list(ids[max(0, start - 16) : start]), skip_special_tokens=False)
        text = self.tokenizer.decode(list(ids[start:end]), skip_special_tokens=True)
        reasoning, content = split_reply(text, opened=ends_inside_thinking(before))
        return Message("assistant", content, reasoning)

    def encode(self, text: str) -> list[int]:
        # The template already wrote every special token; adding BOS/EOS again would change the prompt.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Token counts of many texts in one call to the fast tokenizer (no offsets, no Python objects)."""
        if not texts:
            return []
        backend = self._backend
        if backend is not None:
            encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            return [len(encoding) for encoding in encode(list(texts), add_special_tokens=False)]
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def prompt_ids(self, messages: Sequence[Message], *, enable_thinking: bool, tools: str | None = None) -> list[int]:
        return self.encode(self.render(messages, enable_thinking=enable_thinking, tools=tools))

    def generation_prompt_ids(self, *, enable_thinking: bool) -> list[int]:
        """The ids that open a generated assistant turn (the tail the template adds for generation)."""
        return list(self._generation_prompt(enable_thinking))

    def continuation_ids(
        self, messages: Sequence[Message], *, enable_thinking: bool, last_token: int | None, tools: str | None = None
    ) -> list[int]:
        """Ids that follow a generated assistant turn whose final token is `last_token`: the end of that turn
        (unless the engine already wrote it), `messages` (user and tool turns, assistant tool calls kept
        verbatim), then the next generation prompt."""
        ended_with = ""
        if last_token is not None and last_token in self._special_ids:
            ended_with = self.tokenizer.decode([last_token])
        return self.encode(self._continuations(tuple(messages), enable_thinking, ended_with, tools))

    def _generation_prompt(self, enable_thinking: bool) -> tuple[int, ...]:
        cached = self._generation_prompts
        if enable_thinking not in cached:
            conversation = [{"role": "user", "content": _SENTINEL_USER}]
            with_prompt = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
            )
            without = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=False, enable_thinking=enable_thinking
            )
            if not with_prompt.startswith(without):
                raise ValueError("the chat template's generation prompt is not a suffix of the conversation")
            cached[enable_thinking] = tuple(self.encode(with_prompt[len(without) :]))
        return cached[enable_thinking]

    def _continuation_text(
        self, messages: tuple[Message, ...], enable_thinking: bool, ended_with: str, tools: str | None
    ) -> str:
        opening = [
            {"role": "user", "content": _SENTINEL_USER},
            {"role": "assistant", "content": _SENTINEL_REPLY},
        ]
        rendered = self.tokenizer.apply_chat_template(
            opening + [m.to_json() for m in messages],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            tools=_tool_list(tools),
        )
        position = rendered.find(_SENTINEL_REPLY)
        if position < 0:
            raise ValueError("the chat template dropped an assistant turn; cannot continue a conversation")
        after = rendered[position + len(_SENTINEL_REPLY) :]
        if ended_with and after.startswith(ended_with):
            after = after[len(ended_with) :]
        return after


def _tool_list(tools: str | None) -> list | None:
    return json.loads(tools) if tools is not None else None


def ends_inside_thinking(text: str) -> bool:
    """Whether `text` leaves a thinking block open: its last `<think>` comes after its last `</think>`."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


def split_reply(text: str, *, opened: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated reply; `opened`: the prompt ended inside an open thinking block."""
    full = (THINK_OPEN + text) if opened else text
    if THINK_CLOSE in full:
        before, _, after = full.rpartition(THINK_CLOSE)
        return before.split(THINK_OPEN, 1)[-1].strip("\n"), after.lstrip("\n")
    if THINK_OPEN in full:  # thinking that never closed: no answer
        return full.split(THINK_OPEN, 1)[-1].strip("\n"), ""
    return None, full
