"""Whether a sample is generated with the model's thinking mode on.

Policies: "always", "never", or "auto": rules on the content of the conversation's user turns (the last one
weighs most). Code, math and multi-step reasoning turn thinking on; short chit-chat, classification and
extraction turn it off; anything else is on when the request is long, off when it is short.
"""

from __future__ import annotations

import re
from dataclasses import replace

from dflash_queue.data.samples import Sample

POLICIES = ("always", "never", "auto")

_FLAGS = re.IGNORECASE | re.MULTILINE
# Code: fenced blocks, code syntax, languages and tools, or a request to write code.
_CODE = re.compile(
    r"```|^\s*(def|class|import|from \w+ import|#include|SELECT|public|fn|func)\b|\b\w+\([\w\s,]*\)|=>|!=|==|\w\[\w*\]"
    r"|\.(py|js|ts|rs|go|java|cpp|c|h|sh|sql|csv|json|yaml|toml|jpe?g|png|txt|log)\b|/(usr|var|etc|home|tmp)/"
    r"|\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|postgres(ql)?|mysql|sqlite|bash|shell|zsh"
    r"|powershell|regex|regular expression|jq|git|docker|kubernetes|linux|unix|numpy|pandas|react|html|css"
    r"|compiler|stack trace|traceback|segfault|one-liner|command line|terminal|standard library)\b"
    r"|\b(write|implement|fix|debug|refactor|optimi[sz]e)\b[^.?!]{0,40}\b(function|script|program|class|method"
    r"|query|code|loop|test)s?\b",
    _FLAGS,
)
# Math: arithmetic between numbers, notation, math vocabulary, or a word problem with several numbers.
_MATH = re.compile(
    r"\d\s*[-+*/^×÷=<>−]\s*\d|\d\s*%|\\(frac|sum|int|sqrt|cdot|times|begin)\b|\$[^$\n]+\$"
    r"|\b(solve|prove|proof|equations?|integral|derivative|probability|calculate|compute|how many|how much"
    r"|how long|how old|percent(age)?|theorem|lemma|factorial|factori[sz]e|primes?|matrix|vectors?|geometry"
    r"|triangle|polynomial|expected value|average|divisible|sum of|ratio|simplify|arrangements|interest)\b",
    _FLAGS,
)
_NUMBER = re.compile(r"\d+(\.\d+)?")
_REASONING = re.compile(
    r"\b(step[- ]by[- ]step|explain why|why does|why is|why do|why are|reasoning|compare|trade-?offs?"
    r"|pros and cons|analy[sz]e|puzzle|riddle|logic(al)?|deduce|infer|which is better|what would happen"
    r"|justify|derive|walk me through|think through)\b",
    _FLAGS,
)
_CLASSIFY = re.compile(
    r"\b(classif(y|ier|ication)|categori[sz]e|category|categories|sentiment|label (each|the|this|these)"
    r"|is this (spam|positive|negative)|spam or not|positive or negative|yes or no|true or false"
    r"|which language|formal or informal)\b|\bone of:",
    _FLAGS,
)
_EXTRACT = re.compile(
    r"\b(extract|pull out|list (all|every|the)|find all|named entit(y|ies)|summari[sz]e|translate|rewrite"
    r"|rephrase|paraphrase|proofread|fix the (grammar|spelling)|tl;?dr)\b",
    _FLAGS,
)
_CHITCHAT = re.compile(
    r"^\W*(hi|hello|hey|thanks|thank you|good (morning|evening|night)|how are you|what's up|bye|ok(ay)?|cool"
    r"|nice|great|lovely|lol)\b",
    _FLAGS,
)
# Requests longer than this (characters of the last user turn) think unless a rule says otherwise.
LONG_REQUEST_CHARS = 400


def decide_thinking(sample: Sample) -> tuple[bool, str]:
    """(thinking on?, the rule that decided) for the "auto" policy."""
    users = [m.content for m in sample.messages if m.role == "user"]
    last = users[-1] if users else ""
    system = " ".join(m.content for m in sample.messages if m.role == "system")
    earlier = " ".join(users[:-1])
    if _CLASSIFY.search(last) or _CLASSIFY.search(system):
        return False, "classification"
    if _CODE.search(last):
        return True, "code"
    if _EXTRACT.search(last):
        return False, "extraction"
    if _MATH.search(last) or len(_NUMBER.findall(last)) >= 2 and "?" in last:
        return True, "math"
    if _REASONING.search(last):
        return True, "reasoning"
    if len(last) < 80 and (_CHITCHAT.search(last) or not earlier):
        if _CODE.search(system):
            return True, "code"
        return False, "chit-chat" if _CHITCHAT.search(last) else "short request"
    # A short follow-up ("And the second derivative?") inherits the topic of the conversation.
    if _CODE.search(earlier) or _CODE.search(system):
        return True, "code"
    if _MATH.search(earlier):
        return True, "math"
    if len(last) >= LONG_REQUEST_CHARS:
        return True, "long request"
    return False, "short request"


def apply_thinking_policy(sample: Sample, policy: str) -> Sample:
    if policy == "always":
        return replace(sample, thinking=True)
    if policy == "never":
        return replace(sample, thinking=False)
    if policy == "auto":
        return replace(sample, thinking=decide_thinking(sample)[0])
    raise ValueError(f"unknown thinking policy {policy!r}; expected one of {', '.join(POLICIES)}")
