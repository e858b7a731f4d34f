"""The length filter: prompt tokens counted with the target's tokenizer and chat template, at staging time.

A prompt is skipped when its templated token count plus the generation budget exceeds max_model_len. When
every assistant turn is regenerated, the conversation's other turns plus one generation budget must fit.
Counting is batched: one template call and one fast-tokenizer call per batch of samples (dflash_queue.data.
preparation runs the batches, in this process or in several).

A conversation the chat template refuses (its `raise_exception`: roles that do not alternate, a system turn
the model has no place for) is a bad record naming its file and line, as the generate lane would have found;
the rest of its batch is counted one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jinja2 import TemplateError

from dflash_queue.data.problems import BadRecord
from dflash_queue.data.samples import EncodedSample, Message, Sample

# The kind (BadRecord.kind) of a prompt skipped for its length; other bad records are the template's refusals.
TOO_LONG = "prompt too long"


@dataclass(frozen=True)
class Counted:
    sample: Sample | EncodedSample
    prompt_tokens: int


@dataclass(frozen=True)
class Refused:
    """The chat template raised on this conversation."""

    reason: str

    def record(self, sample: Sample | EncodedSample) -> BadRecord:
        file, line, unit = source_position(sample.source)
        return BadRecord(file, line, f"chat template refused the conversation: {self.reason}", unit=unit)


@dataclass
class Rendered:
    # (positions, templated texts) per thinking setting and tools: the template takes them per call.
    groups: list[tuple[list[int], list[str]]]
    size: int
    refused: dict[int, Refused] = field(default_factory=dict)


def counted_messages(sample: Sample) -> tuple[Message, ...]:
    """The messages whose template rendering is counted: the prompt, or every turn but the final slot."""
    if sample.regenerate == "all":
        return sample.messages[:-1]
    return sample.messages


class LengthFilter:
    def __init__(self, formatter, *, max_model_len: int, budget: int) -> None:
        self.formatter = formatter
        self.max_model_len = max_model_len
        self.budget = budget
        self.limit = max_model_len - budget

    def count(self, samples: list[Sample]) -> list[int | Refused]:
        """Templated prompt tokens of each sample (with its own thinking setting)."""
        return count_prompt_tokens(self.formatter, samples)

    def judge(self, sample: Sample | EncodedSample, tokens: int | Refused) -> Counted | BadRecord:
        """The sample with its count when it fits; a bad record naming its source when it does not, or when the
        template refused it."""
        if not isinstance(tokens, Refused) and tokens <= self.limit:
            return Counted(sample, tokens)
        if isinstance(tokens, Refused):
            return tokens.record(sample)
        file, line, unit = source_position(sample.source)
        return BadRecord(
            file,
            line,
            f"{TOO_LONG}: {tokens} tokens leave {self.max_model_len - tokens} < {self.budget} "
            f"for generation inside max_model_len {self.max_model_len}",
            unit=unit,
        )


def count_prompt_tokens(formatter, samples: list[Sample]) -> list[int | Refused]:
    """Templated prompt tokens of each sample, with its own thinking setting, in two batched calls; `Refused`
    where the template raised."""
    return count_rendered(formatter, render_prompts(formatter, samples))


def render_prompts(formatter, samples: list[Sample]) -> Rendered:
    picks: dict[tuple[bool, str | None], list[int]] = {}
    for index, sample in enumerate(samples):
        picks.setdefault((sample.thinking, sample.tools), []).append(index)
    rendered = Rendered([], len(samples))
    for (thinking, tools), picked in picks.items():
        messages = [counted_messages(samples[i]) for i in picked]
        try:
            rendered.groups.append((picked, formatter.render_batch(messages, enable_thinking=thinking, tools=tools)))
            continue
        except TemplateError:
            pass
        kept, texts = [], []
        for index, conversation in zip(picked, messages):
            try:
                texts.append(formatter.render(conversation, enable_thinking=thinking, tools=tools))
            except TemplateError as exc:
                rendered.refused[index] = Refused(str(exc) or type(exc).__name__)
            else:
                kept.append(index)
        rendered.groups.append((kept, texts))
    return rendered


def count_rendered(formatter, rendered: Rendered) -> list[int | Refused]:
    counts: list[int | Refused] = [0] * rendered.size
    for picked, texts in rendered.groups:
        for index, tokens in zip(picked, formatter.count_tokens(texts)):
            counts[index] = tokens
    for index, refusal in rendered.refused.items():
        counts[index] = refusal
    return counts


def source_position(source: str) -> tuple[str, int, str]:
    """(file, line or row, unit) of a sample's source ("file:line" or "file#row")."""
    for separator, unit in ((":", "line"), ("#", "row")):
        file, found, position = source.rpartition(separator)
        if found and position.isdigit():
            return file, int(position), unit
    return source, 0, "line"
