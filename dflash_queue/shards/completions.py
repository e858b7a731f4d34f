"""Generated replies with the exact token ids the engine produced, and the quality gate's verdict.

One record per sample, dropped ones included (their verdict says so), so that every staged sample is
accounted for. The sequence to train on is `input_ids` = prompt_ids + completion_ids; `loss_mask()` is 1 on
every generated token: the completion, and, when every assistant turn was regenerated, the earlier generated
turns inside prompt_ids (`earlier_turns`).

When the template renders an earlier reply differently from how it was generated (it strips the reasoning of
earlier turns, as Qwen3-style templates do), no single sequence holds every reply as the model produced it in
the context it saw: each earlier turn is then its own training sequence (`served_turns`: that turn's prompt as
the template rendered it, and its reply), and the main sequence trains on the last turn only.
`training_sequences()` lists them all.

Token ids are written as base64 of their little-endian uint32 bytes (`"prompt_ids": "AQAAAAIAAAA="` holds
[1, 2]): a JSON list of ints costs a Python int object per id to parse, most of a shard's read time. Lists of
ints, as earlier versions wrote them, read as before.
"""

from __future__ import annotations

import binascii
import sys
from array import array
from dataclasses import dataclass
from typing import Any, NamedTuple

import pybase64

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.jsonl import dump_jsonl, load_numbered_jsonl
from dflash_queue.shards.verdicts import Verdict


@dataclass(frozen=True)
class TurnSpan:
    """An earlier generated turn: prompt_ids[start:end] are generated ids."""

    start: int
    end: int
    finish_reason: str

    def to_json(self) -> list[Any]:
        return [self.start, self.end, self.finish_reason]

    @classmethod
    def from_json(cls, row: list[Any]) -> TurnSpan:
        start, end, finish_reason = row
        return cls(int(start), int(end), str(finish_reason))


@dataclass(frozen=True)
class ServedTurn:
    """An earlier generated turn kept as its own training sequence: its prompt as served, and its reply."""

    prompt_ids: list[int]
    completion_ids: list[int]
    finish_reason: str

    def to_json(self, *, ids_as_lists: bool = False) -> dict[str, Any]:
        ids = _ids_writer(ids_as_lists)
        return {"prompt_ids": ids(self.prompt_ids), "completion_ids": ids(self.completion_ids),
                "finish_reason": self.finish_reason}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> ServedTurn:
        return cls(_ids_at(row, "prompt_ids"), _ids_at(row, "completion_ids"), str(row["finish_reason"]))


class GeneratedTurn(NamedTuple):
    """A generated turn: ids[start:end] of the sequence that holds it."""

    ids: list[int]
    start: int
    end: int
    finish_reason: str


@dataclass(frozen=True)
class TrainingSequence:
    input_ids: list[int]
    loss_mask: list[int]
    finish_reason: str
    # The regenerated turn this sequence ends with, when a sample is stored as one sequence per turn.
    turn: int | None = None


@dataclass(frozen=True)
class CompletionRecord:
    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    finish_reason: str
    thinking: bool
    text: str
    source: str = ""
    earlier_turns: tuple[TurnSpan, ...] = ()
    quality: Verdict | None = None
    served_turns: tuple[ServedTurn, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens of every training sequence."""
        served = sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.served_turns)
        return len(self.prompt_ids) + len(self.completion_ids) + served

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def kept(self) -> bool:
        """False when the quality gate dropped the sample: it is recorded here but never extracted."""
        return self.quality is None or self.quality.kept

    @property
    def generated_tokens(self) -> int:
        earlier = sum(t.end - t.start for t in self.earlier_turns) + sum(len(t.completion_ids) for t in self.served_turns)
        return len(self.completion_ids) + earlier

    def generated_turns(self) -> list[GeneratedTurn]:
        """Every generated turn, in order, with the sequence that holds it."""
        turns = [
            GeneratedTurn(t.prompt_ids + t.completion_ids, len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids),
                          t.finish_reason)
            for t in self.served_turns
        ]
        ids = self.input_ids
        turns += [GeneratedTurn(ids, t.start, t.end, t.finish_reason) for t in self.earlier_turns]
        turns.append(GeneratedTurn(ids, len(self.prompt_ids), len(ids), self.finish_reason))
        return turns

    def turn_finish_reasons(self) -> list[str]:
        """The finish reason of every generated turn, in order."""
        return [turn.finish_reason for turn in self.generated_turns()]

    def loss_mask(self) -> list[int]:
        mask = [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)
        for turn in self.earlier_turns:
            mask[turn.start : turn.end] = [1] * (turn.end - turn.start)
        return mask

    def training_sequences(self) -> list[TrainingSequence]:
        """What the extract lane prefills: each served turn on its own, then the main sequence."""
        sequences = [
            TrainingSequence(
                t.prompt_ids + t.completion_ids,
                [0] * len(t.prompt_ids) + [1] * len(t.completion_ids),
                t.finish_reason,
                turn,
            )
            for turn, t in enumerate(self.served_turns)
        ]
        last = len(self.served_turns) if self.served_turns else None
        sequences.append(TrainingSequence(self.input_ids, self.loss_mask(), self.finish_reason, last))
        return sequences

    def to_json(self, *, ids_as_lists: bool = False) -> dict[str, Any]:
        """The record as one JSON object; token ids as base64 (see the module's docstring), or as lists of ints."""
        ids = _ids_writer(ids_as_lists)
        row: dict[str, Any] = {
            "id": self.id,
            "prompt_ids": ids(self.prompt_ids),
            "completion_ids": ids(self.completion_ids),
            "finish_reason": self.finish_reason,
            "thinking": self.thinking,
            "text": self.text,
            "source": self.source,
        }
        if self.earlier_turns:
            row["turns"] = [t.to_json() for t in self.earlier_turns]
        if self.quality is not None:
            row["quality"] = self.quality.to_json()
        if self.served_turns:
            row["served_turns"] = [t.to_json(ids_as_lists=ids_as_lists) for t in self.served_turns]
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> CompletionRecord:
        try:
            record = cls(
                id=row["id"],
                prompt_ids=_ids_at(row, "prompt_ids"),
                completion_ids=_ids_at(row, "completion_ids"),
                finish_reason=row["finish_reason"],
                thinking=bool(row["thinking"]),
                text=row.get("text", ""),
                source=row.get("source", ""),
                earlier_turns=tuple(TurnSpan.from_json(t) for t in row.get("turns", ())),
                quality=Verdict.from_json(row["quality"]) if row.get("quality") is not None else None,
                served_turns=tuple(ServedTurn.from_json(t) for t in row.get("served_turns", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            name = row.get("id", "?") if isinstance(row, dict) else "?"
            raise ShardFormatError(f"completion record {name}: {exc!r}") from None
        for turn in record.earlier_turns:
            if not 0 <= turn.start <= turn.end <= len(record.prompt_ids):
                raise ShardFormatError(f"completion record {record.id}: turn span {turn} outside the prompt")
        return record


def encode_token_ids(ids: list[int]) -> str:
    """Base64 of the ids as little-endian uint32; OverflowError for an id outside 0..2**32-1."""
    packed = array(_UINT32, ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return pybase64.b64encode(packed.tobytes()).decode("ascii")


def token_ids(values: Any) -> list[int]:
    """Stored token ids as a list of ints: base64 as `encode_token_ids` writes it, a decoded list of ints as it
    is (one type check in C), anything else converted element by element with int(), which raises on what is
    not a token id."""
    if type(values) is str:
        try:
            raw = _b64decode(values)
        except binascii.Error as exc:
            raise ValueError(f"token ids are not base64: {exc}") from None
        if len(raw) % 4:
            raise ValueError(f"token ids are {len(raw)} bytes of base64, not a whole number of uint32")
        packed = array(_UINT32)
        packed.frombytes(raw)
        if _BIG_ENDIAN:
            packed.byteswap()
        return packed.tolist()
    if type(values) is list and set(map(type, values)) <= _INT:
        return values
    return [int(t) for t in values]


def _b64decode(text: str) -> bytes:
    """Strict base64 (padding required, nothing but the alphabet) through pybase64's SIMD decoder, ~50x the
    standard library's; what it refuses goes to the standard library, whose error says why."""
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return binascii.a2b_base64(text, strict_mode=True)


def _ids_at(row: dict[str, Any], key: str) -> list[int]:
    try:
        return token_ids(row[key])
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{key}: {exc}") from None


_INT = {int}
_BIG_ENDIAN = sys.byteorder == "big"
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)


def _ids_writer(as_lists: bool) -> Any:
    return list if as_lists else encode_token_ids


def encode_completions(records: list[CompletionRecord], *, ids_as_lists: bool = False) -> bytes:
    """JSON lines, one record each; `ids_as_lists` writes token ids as JSON lists of ints (as earlier versions did)."""
    return dump_jsonl(r.to_json(ids_as_lists=ids_as_lists) for r in records)


def decode_completions(data: bytes, *, what: str) -> list[CompletionRecord]:
    records = []
    for line_no, row in load_numbered_jsonl(data, what=what):
        try:
            records.append(CompletionRecord.from_json(row))
        except ShardFormatError as exc:
            raise ShardFormatError(f"{what}:{line_no}: {exc}") from None
    return records
