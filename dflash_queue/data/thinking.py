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

# Rules look at lower-cased words and word pairs (set lookups, linear in the text) and at a few syntax
# patterns; big case-insensitive alternations would cost tens of microseconds per sample at staging time.
_WORD = re.compile(r"[a-z0-9+#]+(?:['-][a-z0-9]+)*")

# Code: fenced blocks, code syntax, file names and paths, languages and tools, or a request to write code.
_CODE_SYNTAX = re.compile(
    r"```|^\s*(def|class|import|from \w+ import|#include|SELECT|public|fn|func)\b|(?<=\w)\([\w\s,]*\)|=>|!=|==|(?<=\w)\[\w*\]"
    r"|\.(py|js|ts|rs|go|java|cpp|c|h|sh|sql|csv|json|yaml|toml|jpe?g|png|txt|log)\b|/(usr|var|etc|home|tmp)/",
    re.MULTILINE,
)
_CODE_WORDS = frozenset(
    "python javascript typescript java c++ rust golang sql postgres postgresql mysql sqlite bash shell zsh powershell"
    " regex jq git docker kubernetes linux unix numpy pandas react html css compiler traceback segfault one-liner"
    .split()
) | {"regular expression", "stack trace", "command line", "standard library"}
_CODE_VERBS = frozenset("write implement fix debug refactor optimize optimise".split())
_CODE_REQUEST = re.compile(
    r"\b(write|implement|fix|debug|refactor|optimi[sz]e)\b[^.?!]{0,40}\b(function|script|program|class|method"
    r"|query|code|loop|test)s?\b"
)
# Math: arithmetic between numbers, notation, math vocabulary, or a word problem with several numbers.
_MATH_SYNTAX = re.compile(r"(?<=\d)\s*[-+*/^×÷=<>−]\s*\d|(?<=\d)\s*%|\\(frac|sum|int|sqrt|cdot|times|begin)\b|\$[^$\n]+\$")
_MATH_WORDS = frozenset(
    "solve prove proof equation equations integral derivative probability calculate compute percent percentage"
    " theorem lemma factorial factorize factorise prime primes matrix vector vectors geometry triangle polynomial"
    " average divisible ratio simplify arrangements interest".split()
) | {"how many", "how much", "how long", "how old", "expected value", "sum of"}
_NUMBER = re.compile(r"\d+(\.\d+)?")
_REASONING_WORDS = frozenset(
    "step-by-step reasoning compare trade-offs tradeoffs trade-off analyze analyse puzzle riddle logic logical"
    " deduce infer justify derive".split()
) | {"step by", "explain why", "why does", "why is", "why do", "why are", "pros and", "which is", "would happen",
     "walk me", "think through"}
_CLASSIFY_WORDS = frozenset(
    "classify classifier classification categorize categorise category categories sentiment".split()
) | {"label each", "label the", "label this", "label these", "is this", "spam or", "positive or", "yes or",
     "true or", "which language", "formal or", "one of"}
_EXTRACT_WORDS = frozenset(
    "extract summarize summarise translate rewrite rephrase paraphrase proofread tl;dr tldr".split()
) | {"pull out", "list all", "list every", "list the", "find all", "named entity", "named entities",
     "fix the"}
_CHITCHAT_OPENERS = frozenset("hi hello hey thanks thank bye ok okay cool nice great lovely lol".split()) | {
    "good morning", "good evening", "good night", "how are", "what's up"}
# Requests longer than this (characters of the last user turn) think unless a rule says otherwise.
LONG_REQUEST_CHARS = 400


def _vocabulary(text: str) -> tuple[list[str], set[str]]:
    words = _WORD.findall(text.lower())
    vocabulary = set(words)
    vocabulary.update(f"{a} {b}" for a, b in zip(words, words[1:]))
    return words, vocabulary


def _is_code(text: str, vocabulary: set[str]) -> bool:
    if not vocabulary.isdisjoint(_CODE_WORDS) or _CODE_SYNTAX.search(text):
        return True
    return not vocabulary.isdisjoint(_CODE_VERBS) and _CODE_REQUEST.search(text.lower()) is not None


def _is_math(text: str, vocabulary: set[str]) -> bool:
    return not vocabulary.isdisjoint(_MATH_WORDS) or _MATH_SYNTAX.search(text) is not None


def _is_classification(vocabulary: set[str]) -> bool:
    if "is this" in vocabulary:
        vocabulary = vocabulary - {"is this"} if not {"spam", "positive", "negative"} & vocabulary else vocabulary
    return not vocabulary.isdisjoint(_CLASSIFY_WORDS)


def _is_extraction(vocabulary: set[str]) -> bool:
    if "fix the" in vocabulary and not {"grammar", "spelling"} & vocabulary:
        vocabulary = vocabulary - {"fix the"}
    return not vocabulary.isdisjoint(_EXTRACT_WORDS)


def decide_thinking(sample: Sample) -> tuple[bool, str]:
    """(thinking on?, the rule that decided) for the "auto" policy."""
    users = [m.content for m in sample.messages if m.role == "user"]
    last = users[-1] if users else ""
    system = " ".join(m.content for m in sample.messages if m.role == "system")
    earlier = " ".join(users[:-1])
    words, vocabulary = _vocabulary(last)
    system_vocabulary = _vocabulary(system)[1] if system else set()
    if _is_classification(vocabulary) or _is_classification(system_vocabulary):
        return False, "classification"
    if _is_code(last, vocabulary):
        return True, "code"
    if _is_extraction(vocabulary):
        return False, "extraction"
    if _is_math(last, vocabulary) or len(_NUMBER.findall(last)) >= 2 and "?" in last:
        return True, "math"
    if not vocabulary.isdisjoint(_REASONING_WORDS):
        return True, "reasoning"
    chitchat = bool(words) and (words[0] in _CHITCHAT_OPENERS or " ".join(words[:2]) in _CHITCHAT_OPENERS)
    if len(last) < 80 and (chitchat or not earlier):
        if system and _is_code(system, system_vocabulary):
            return True, "code"
        return False, "chit-chat" if chitchat else "short request"
    # A short follow-up ("And the second derivative?") inherits the topic of the conversation.
    earlier_vocabulary = _vocabulary(earlier)[1]
    if _is_code(earlier, earlier_vocabulary) or (system and _is_code(system, system_vocabulary)):
        return True, "code"
    if _is_math(earlier, earlier_vocabulary):
        return True, "math"
    if len(last) >= LONG_REQUEST_CHARS:
        return True, "long request"
    return False, "short request"


def apply_thinking_policy(sample: Sample, policy: str) -> Sample:
    if policy == "always":
        thinking = True
    elif policy == "never":
        thinking = False
    elif policy == "auto":
        thinking = decide_thinking(sample)[0]
    else:
        raise ValueError(f"unknown thinking policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return sample if sample.thinking == thinking else replace(sample, thinking=thinking)
