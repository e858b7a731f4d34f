"""What gets regenerated: a conversation -> the sample a generate task works on.

regenerate="last" (default): the last assistant turn is dropped and regenerated from the conversation before
it; earlier assistant turns stay as context. A conversation ending on a user (or tool) turn is a prompt as it
stands.

regenerate="all": every assistant turn that answers becomes a slot, filled in order, each conditioned on the
filled ones; a conversation ending on a user (or tool) turn gets one more slot at the end.

Tool use: an assistant turn that calls tools is kept verbatim with the tool results that answer it (regenerating
it would need the tools run again, and its results would answer a call that no longer exists); only the turns
that answer (the final answers) are regenerated. A conversation ending on a tool call regenerates that last
turn (nothing depends on it). The record's `tools` go to the chat template with every rendering.
"""

from __future__ import annotations

from dflash_queue.data.samples import SLOT, Message, Regenerate, Sample, sample_id
from dflash_queue.data.schemas import Conversation, RecordError

_ANSWERABLE = ("user", "tool")


def to_sample(conversation: Conversation, *, source: str, regenerate: Regenerate = "last") -> Sample:
    messages = list(conversation.messages)
    field = "conversations" if conversation.schema == "sharegpt" else "messages"
    if not any(m.role == "user" for m in messages):
        raise RecordError("no user turn to answer")
    if regenerate == "all":
        return _all_turns(messages, source=source, field=field, tools=conversation.tools)
    reference = None
    if messages[-1].role == "assistant":
        reference = messages[-1].content
        messages = messages[:-1]
    if not messages or messages[-1].role not in _ANSWERABLE:
        last = messages[-1].role if messages else "nothing"
        raise RecordError(f"conversation ends on a {last} turn, not a user turn")
    for index, message in enumerate(messages):
        if message.role == "assistant" and not (message.content.strip() or message.tool_calls):
            raise RecordError("empty content", _key(conversation, field, index))
    prompt = tuple(messages)
    return Sample(
        id=sample_id(prompt, conversation.tools),
        messages=prompt,
        source=source,
        reference=reference,
        regenerate="last",
        tools=conversation.tools,
    )


def _all_turns(messages: list[Message], *, source: str, field: str, tools: str | None) -> Sample:
    reference = messages[-1].content if messages[-1].role == "assistant" else None
    if messages[-1].role != "assistant":
        messages = [*messages, SLOT]
    elif messages[-1].tool_calls is not None:
        messages = [*messages[:-1], SLOT]  # a closing tool call: regenerated, nothing depends on it
    skeleton: list[Message] = []
    for index, message in enumerate(messages):
        if message.role != "assistant" or message.tool_calls is not None:
            skeleton.append(message)  # tool calls stay verbatim, with the results that answer them
            continue
        if not skeleton or skeleton[-1].role not in _ANSWERABLE:
            before = skeleton[-1].role if skeleton else "nothing"
            raise RecordError(
                f"assistant turn follows {before}, not a user or tool turn; cannot regenerate it",
                f"{field}[{index}]",
            )
        skeleton.append(SLOT)
    turns = tuple(skeleton)
    return Sample(
        id=sample_id(turns, tools), messages=turns, source=source, reference=reference, regenerate="all", tools=tools
    )


def _key(conversation: Conversation, field: str, index: int) -> str:
    content = "value" if conversation.schema == "sharegpt" else "content"
    return f"{field}[{index}].{content}"
