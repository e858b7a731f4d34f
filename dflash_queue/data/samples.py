"""The unit of work: one conversation prefix to regenerate a reply for."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: Role
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Sample:
    """A prompt (the conversation up to the turn to regenerate) and where it came from."""

    id: str
    messages: tuple[Message, ...]
    source: str
    thinking: bool = True
    # The dataset's own reply that the target model regenerates; kept for audits only.
    reference: str | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "messages": [m.to_json() for m in self.messages],
            "thinking": self.thinking,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        return cls(
            id=data["id"],
            messages=tuple(Message(m["role"], m["content"]) for m in data["messages"]),
            source=data.get("source", ""),
            thinking=bool(data.get("thinking", True)),
        )


def sample_id(messages: tuple[Message, ...]) -> str:
    """A stable id from the normalised prompt: the same conversation prefix always gets the same id."""
    canonical = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]
