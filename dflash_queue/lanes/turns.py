"""Generating the assistant turns of a shard, judged by the quality gate as they come.

Round k generates turn k of every sample that has one, in one engine call. By default a sample has one turn
(one round). When every assistant turn is regenerated (`dataset.regenerate = "all"`), the history of turn k+1
is, by `dataset.history`:

* "as-served" (default): what a serving stack sends. Each reply becomes an assistant message (the answer as
  content, the reasoning as `reasoning_content`) and the next prompt is the chat template's rendering of the
  conversation so far, so a template that strips earlier reasoning strips it here too. When every earlier reply
  appears in the final prompt exactly as generated, the sample is one training sequence with every reply in the
  loss mask; otherwise each turn is its own training sequence (its prompt as served, its reply), so that no
  trained token sits in a context the model did not see (`CompletionRecord.served_turns`);
* "as-generated": the current sequence plus the continuation the template writes after an assistant turn
  (next user/tool turns, next generation prompt), never a re-rendered copy: one sequence holding every turn's
  exact ids, reasoning included.

A turn the gate sends back is generated once more in the same round with the retry budget; a dropped sample
stops there and is recorded with its verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.samples import Message, Sample
from dflash_queue.engines.base import GenerateEngine, Generation, GenerationRequest
from dflash_queue.quality.gate import DROP, RETRY, QualityGate, TurnVerdict, combine_turns
from dflash_queue.shards.completions import CompletionRecord, ServedTurn, TurnSpan


def split_turns(sample: Sample) -> tuple[tuple[Message, ...], list[tuple[Message, ...]]]:
    """(messages before the first generated turn, messages between each generated turn and the next)."""
    if sample.regenerate == "last":
        return sample.messages, []
    segments: list[list[Message]] = [[]]
    for message in sample.messages:
        if message.is_slot:
            segments.append([])
        else:
            segments[-1].append(message)
    # The last message is always a slot, so the last segment is empty and belongs to no turn.
    return tuple(segments[0]), [tuple(s) for s in segments[1:-1]]


@dataclass
class _Conversation:
    sample: Sample
    between: list[tuple[Message, ...]]
    ids: list[int]
    turn_start: int
    completion_start: int = 0
    spans: list[TurnSpan] = field(default_factory=list)
    verdicts: list[TurnVerdict] = field(default_factory=list)
    last: Generation | None = None
    dropped: bool = False
    # As served: the conversation so far as messages, and (prompt, reply, finish reason) of every turn.
    history: list[Message] = field(default_factory=list)
    served: list[ServedTurn] = field(default_factory=list)

    @property
    def turns_done(self) -> int:
        return len(self.verdicts)

    @property
    def active(self) -> bool:
        return not self.dropped and self.turns_done < len(self.between) + 1


class TurnGenerator:
    def __init__(
        self,
        engine: GenerateEngine,
        formatter: ChatFormatter,
        gate: QualityGate,
        *,
        max_tokens: int,
        retry_max_tokens: int,
        max_model_len: int,
        history: str = "as-served",
    ) -> None:
        if history not in ("as-served", "as-generated"):
            raise ValueError(f"history must be 'as-served' or 'as-generated', got {history!r}")
        self.history = history
        self.engine = engine
        self.formatter = formatter
        self.gate = gate
        self.max_tokens = max_tokens
        self.retry_max_tokens = retry_max_tokens
        self.max_model_len = max_model_len

    def run(self, samples: Sequence[Sample]) -> list[CompletionRecord]:
        conversations = [self._start(sample) for sample in samples]
        while active := [c for c in conversations if c.active]:
            self._round(active)
        return [self._record(c) for c in conversations]

    def _start(self, sample: Sample) -> _Conversation:
        first, between = split_turns(sample)
        ids = self.formatter.prompt_ids(first, enable_thinking=sample.thinking, tools=sample.tools)
        return _Conversation(sample, between, ids, self._turn_start(ids, sample.thinking), history=list(first))

    def _turn_start(self, ids: list[int], thinking: bool) -> int:
        """Where the generation prompt that opens the current turn begins (the turn is judged from there)."""
        opening = self.formatter.generation_prompt_ids(enable_thinking=thinking)
        if opening and ids[-len(opening) :] == opening:
            return len(ids) - len(opening)
        return len(ids)

    def _round(self, active: list[_Conversation]) -> None:
        generations = self._generate(active, self.max_tokens, attempt=0)
        verdicts = [self._judge(c, g) for c, g in zip(active, generations)]
        again = [i for i, v in enumerate(verdicts) if v.decision == RETRY]
        if again:
            retried = self._generate([active[i] for i in again], self.retry_max_tokens, attempt=1)
            for index, generation in zip(again, retried):
                generations[index] = generation
                reasons = tuple(c for c in verdicts[index].failed if self.gate.policy[c] == RETRY)
                verdicts[index] = self._judge(active[index], generation, retried=reasons)
        for conversation, generation, verdict in zip(active, generations, verdicts):
            self._finish_turn(conversation, generation, verdict)

    def _generate(self, conversations: list[_Conversation], budget: int, *, attempt: int) -> list[Generation]:
        out: list[Generation | None] = [None] * len(conversations)
        requests, positions = [], []
        for index, c in enumerate(conversations):
            room = min(budget, self.max_model_len - len(c.ids))
            if room <= 0:
                # No room left in the context: an empty, truncated turn, judged like any other.
                out[index] = Generation(c.sample.id, list(c.ids), [], "length", "")
                continue
            max_tokens = None if room == self.max_tokens else room
            requests.append(GenerationRequest(c.sample.id, list(c.ids), max_tokens=max_tokens, attempt=attempt))
            positions.append(index)
        if requests:
            for index, generation in zip(positions, self.engine.generate(requests), strict=True):
                out[index] = generation
        return out  # type: ignore[return-value]

    def _judge(self, c: _Conversation, g: Generation, *, retried: tuple[str, ...] = ()) -> TurnVerdict:
        turn = c.ids[c.turn_start :] + g.completion_ids
        return self.gate.judge(turn, len(c.ids) - c.turn_start, g.finish_reason, retried=retried)

    def _finish_turn(self, c: _Conversation, g: Generation, verdict: TurnVerdict) -> None:
        c.completion_start = len(c.ids)
        c.served.append(ServedTurn(list(c.ids), list(g.completion_ids), g.finish_reason))
        c.ids.extend(g.completion_ids)
        c.verdicts.append(verdict)
        c.last = g
        if verdict.decision == DROP:
            c.dropped = True
            return
        if not c.active:
            return
        if self.history == "as-served":
            reply = self.formatter.reply_message(c.ids, c.completion_start, len(c.ids))
            c.history += [reply, *c.between[c.turns_done - 1]]
            c.ids = self.formatter.prompt_ids(c.history, enable_thinking=c.sample.thinking, tools=c.sample.tools)
            c.turn_start = self._turn_start(c.ids, c.sample.thinking)
            return
        c.spans.append(TurnSpan(c.completion_start, len(c.ids), g.finish_reason))
        last_token = g.completion_ids[-1] if g.finish_reason == "stop" and g.completion_ids else None
        c.ids.extend(
            self.formatter.continuation_ids(
                c.between[c.turns_done - 1],
                enable_thinking=c.sample.thinking,
                last_token=last_token,
                tools=c.sample.tools,
            )
        )
        c.turn_start = self._turn_start(c.ids, c.sample.thinking)

    def _record(self, c: _Conversation) -> CompletionRecord:
        assert c.last is not None
        prompt = c.ids[: c.completion_start]
        spans = tuple(c.spans)
        served: tuple[ServedTurn, ...] = ()
        if self.history == "as-served" and len(c.served) > 1:
            earlier = c.served[:-1]
            if all(prompt[: len(t.prompt_ids) + len(t.completion_ids)] == t.prompt_ids + t.completion_ids
                   for t in earlier):
                # Every earlier reply sits in the final prompt as generated, after the context it was generated in.
                spans = tuple(
                    TurnSpan(len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids), t.finish_reason)
                    for t in earlier
                )
            else:
                served = tuple(earlier)
        return CompletionRecord(
            id=c.sample.id,
            prompt_ids=prompt,
            completion_ids=c.ids[c.completion_start :],
            finish_reason=c.last.finish_reason,
            # What the prompt did, as the template decides (a thinking-first template thinks whatever was asked).
            thinking=self.formatter.effective_thinking(c.sample.thinking),
            text=c.last.text,
            source=c.sample.source,
            earlier_turns=spans,
            quality=combine_turns(c.verdicts),
            served_turns=served,
        )
