"""Answers that hold no answer: the stock filler that ruined datasets ("OK.", "Sure.", "N/A", "TODO", "...").

A short answer is not a placeholder: "Paris.", "4." or a one-word label can be exactly right, so "yes", "no" and
"none" are not filler. The one definition: the quality gate's stub check and `audit` (a dataset's existing
replies and the produced outputs) both use it.
"""

from __future__ import annotations

import re

FILLER = (
    r"ok(ay)?|sure|certainly|of course|n/?a|null|nil|todo|tbd|placeholder|lorem ipsum.*|response|answer|output"
    r"|got it|done|thanks?|thank you|noted|understood|\.{2,}|…+|-+|<\w+>|\[\w+\]|\{\w+\}"
)
PLACEHOLDER_ANSWER = re.compile(rf"^\W*({FILLER})\W*$", re.IGNORECASE | re.DOTALL)


def is_placeholder(answer: str) -> bool:
    """Nothing, no letter or digit, or stock filler only."""
    text = answer.strip()
    return not any(c.isalnum() for c in text) or PLACEHOLDER_ANSWER.match(text) is not None
