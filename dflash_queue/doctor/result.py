"""One preflight check's verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["pass", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str

    @classmethod
    def passed(cls, name: str, detail: str) -> Check:
        return cls(name, "pass", detail)

    @classmethod
    def warned(cls, name: str, detail: str) -> Check:
        return cls(name, "warn", detail)

    @classmethod
    def failed(cls, name: str, detail: str) -> Check:
        return cls(name, "fail", detail)
