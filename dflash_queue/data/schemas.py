"""Record schemas: ShareGPT, OpenAI messages and plain prompts -> one normalised conversation.

Roles are normalised to system / user / assistant / tool. Anything that cannot become a conversation raises
`RecordError` with the reason and the key to blame (`conversations[2].from`), never another exception.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflash_queue import jsoncodec
from dflash_queue.data.samples import Message, canonical_json

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
    # LLaMA-Factory's ShareGPT: the assistant's tool call, its value a JSON {"name", "arguments"} (or a list).
    "function_call": "assistant",
}
OPENAI_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
}


class RecordError(ValueError):
    """A record that cannot become a sample; `key` points at the offending field."""

    def __init__(self, reason: str, key: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.key = key


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    schema: str
    # The record's tool schemas as canonical JSON (a list), handed to the chat template; None without tools.
    tools: str | None = None


def parse_record(data: Any) -> Conversation:
    """The conversation of a ShareGPT (`conversations`), OpenAI (`messages`) or plain (`prompt`) record."""
    if not isinstance(data, dict):
        raise RecordError(f"not a JSON object: got {type(data).__name__}")
    if data.get("conversations") is not None:
        turns = _maybe_json(data["conversations"], "conversations")
        messages = _parse_turns(turns, "conversations", "from", "value", SHAREGPT_ROLES)
        system = data.get("system")
        if system is not None and not (messages and messages[0].role == "system"):
            text = _text(system, "system", allow_empty=True)
            if text.strip():
                messages.insert(0, Message("system", text))
        return Conversation(tuple(messages), "sharegpt", _tools(data.get("tools")))
    if data.get("messages") is not None:
        turns = _maybe_json(data["messages"], "messages")
        messages = _parse_turns(turns, "messages", "role", "content", OPENAI_ROLES)
        return Conversation(tuple(messages), "openai", _tools(data.get("tools")))
    if data.get("prompt") is not None:
        return Conversation(tuple(_parse_prompt(data)), "prompt")
    raise RecordError("no conversation: expected a 'conversations' or 'messages' list or a 'prompt' string")


def _maybe_json(value: Any, key: str) -> Any:
    # Some exports (Parquet/CSV conversions) store the turn list as a JSON string.
    if isinstance(value, str):
        try:
            return jsoncodec.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise RecordError("malformed JSON in a string-encoded turn list", key) from None
    return value


def _parse_prompt(data: dict[str, Any]) -> list[Message]:
    messages = []
    system = data.get("system")
    if system is not None:
        text = _text(system, "system", allow_empty=True)
        if text.strip():
            messages.append(Message("system", text))
    messages.append(Message("user", _text(data["prompt"], "prompt")))
    response = data.get("response")
    if response is not None:
        messages.append(Message("assistant", _text(response, "response", allow_empty=True)))
    return messages


def _parse_turns(turns: Any, field: str, role_key: str, content_key: str, roles: dict[str, str]) -> list[Message]:
    if not isinstance(turns, list):
        raise RecordError(f"wrong type: expected a list, got {type(turns).__name__}", field)
    if not turns:
        raise RecordError("empty conversation", field)
    messages = []
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            raise RecordError(f"wrong type: expected an object, got {type(turn).__name__}", where)
        role_value = turn.get(role_key)
        if not isinstance(role_value, str):
            raise RecordError(f"missing or non-string role: {_short(role_value)}", f"{where}.{role_key}")
        role = roles.get(role_value.strip().lower())
        if role is None:
            raise RecordError(f"unknown role: {_short(role_value)}", f"{where}.{role_key}")
        tool_calls = _tool_calls(turn.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else None
        if role_value.strip().lower() == "function_call":
            messages.append(Message("assistant", "", None, _sharegpt_call(turn.get(content_key), f"{where}.{content_key}")))
            continue
        reasoning = None
        if role == "assistant" and turn.get("reasoning_content") is not None:
            reasoning = _text(turn["reasoning_content"], f"{where}.reasoning_content", allow_empty=True)
        raw_content = turn.get(content_key)
        if raw_content is None and role == "assistant" and tool_calls is not None:
            content = ""
        else:
            content = _content(raw_content, f"{where}.{content_key}", allow_empty=role == "assistant")
        messages.append(Message(role, content, reasoning, tool_calls))  # type: ignore[arg-type]
    return messages


def _content(value: Any, key: str, *, allow_empty: bool) -> str:
    # OpenAI content may be a list of parts; only text parts can be regenerated from.
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RecordError(f"unsupported content part: {_short(kind)}", f"{key}[{index}]")
            texts.append(_text(part.get("text"), f"{key}[{index}].text", allow_empty=True))
        value = "\n".join(texts)
    return _text(value, key, allow_empty=allow_empty)


def _text(value: Any, key: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RecordError(f"wrong type: content must be a string, got {type(value).__name__}", key)
    if not allow_empty and not value.strip():
        raise RecordError("empty content", key)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError("invalid Unicode: lone surrogate in text", key) from None
    return value


def _tool_calls(value: Any, key: str) -> str | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(call, dict) for call in value):
        raise RecordError("wrong type: tool_calls must be a list of objects", key)
    try:
        text = canonical_json(value)
        text.encode("utf-8")
        return text
    except (TypeError, ValueError, RecursionError):
        raise RecordError("tool_calls cannot be encoded as JSON", key) from None


def _tools(value: Any) -> str | None:
    """A record's `tools`: a list of schemas, or that list as a JSON string (ShareGPT exports)."""
    if value is None or value == [] or value == "":
        return None
    value = _maybe_json(value, "tools")
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise RecordError("wrong type: tools must be a list of objects", "tools")
    try:
        return canonical_json(value)
    except (TypeError, ValueError, RecursionError):
        raise RecordError("tools cannot be encoded as JSON", "tools") from None


def _sharegpt_call(value: Any, key: str) -> str:
    """A ShareGPT `function_call` turn's value -> OpenAI-style tool_calls."""
    calls = _maybe_json(value, key)
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise RecordError('a function_call must be a JSON object with a "name" (or a list of them)', key)
    return _tool_calls(
        [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls],
        key,
    )  # type: ignore[return-value]


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
