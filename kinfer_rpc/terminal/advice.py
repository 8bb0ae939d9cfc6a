"""What to do next after a mistake: the closest names to a misspelt one (difflib), and for each
error a server can answer, the words a person uses and the command that helps."""

from __future__ import annotations

import difflib
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

import attrs

# The protocol's codes (spec/specification.md), as the client raises them
MODEL_NOT_FOUND = -31001
CONTEXT_OVERFLOW = -31002
LOAD_FAILED = -31003
QUEUE_FULL = -31004
BACKEND_UNAVAILABLE = -31005
NOT_SUPPORTED = -31006
SERVER_GONE = -32099
INVALID_PARAMS = -32602
CANCELLED = -32800


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The choices nearest to `word`, best first: those it begins (a typed prefix), then those
    difflib finds close, as a whole or in the part a person types: the same length of the
    choice's start (`smolm2` for smollm2-135m-instruct), the name without its tag or namespace."""
    pool = list(dict.fromkeys(choices))
    w = word.casefold()
    if not w:
        return []
    begun = [c for c in pool if c.casefold().startswith(w) and c != word]

    def score(choice: str) -> float:
        c = choice.casefold()
        parts = {c, c[: len(w)], c.split(":")[0], c.rsplit("/", 1)[-1]}
        return max(difflib.SequenceMatcher(None, w, p).ratio() for p in parts if p)

    scored = sorted(((score(c), c) for c in pool if c not in begun and c != word), key=lambda x: -x[0])
    best = scored[0][0] if scored else 0.0
    # close enough, and about as close as the closest (lst: list, not stop)
    return (begun + [c for s, c in scored if s >= 0.65 and s >= best - 0.15])[:n]


def did_you_mean(word: str, choices: Iterable[str], shown: Callable[[str], str] = str) -> str:
    """' Did you mean X?' (or 'X or Y'), '' when nothing is close; `shown` turns a match into the
    spelling to suggest."""
    matches = list(dict.fromkeys(shown(m) for m in closest(word, choices)))
    if not matches:
        return ""
    return " Did you mean " + " or ".join(repr(m) for m in matches[:2]) + "?"


@attrs.frozen
class Advice:
    """An error as a person reads it: what happened, then the next steps (commands to type)."""

    message: str
    steps: tuple[str, ...] = ()

    def text(self, width: int | None = None, first: str = "") -> str:
        """The message (after `first`), then a step a line; wrapped at words to `width`."""
        if width is None:
            return "\n".join([first + self.message, *(f"  {s}" for s in self.steps)])
        lines = textwrap.wrap(first + self.message, width, subsequent_indent="  ", break_on_hyphens=False)
        for step in self.steps:
            lines += textwrap.wrap(step, width, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
        return "\n".join(lines)

    def json(self, code: int | None = None, data: Any = None) -> dict[str, Any]:
        error: dict[str, Any] = {"message": self.message, "steps": list(self.steps)}
        if code is not None:
            error["code"] = code
        if data is not None:
            error["data"] = data
        return {"error": error}


def model_not_found(name: str, available: list[str]) -> Advice:
    near = closest(name, available)
    steps = []
    if near:
        steps.append(f"Did you mean {' or '.join(near[:2])}?")
    elif available and len(available) <= 8:
        steps.append(f"The models here: {', '.join(available)}")
    steps.append("`kinfer list` shows the models this machine has")
    if not name.startswith(("/", ".", "~")) and not name.endswith(".gguf"):  # a registry's name, not a path
        steps.append(f"To download it: kinfer pull {name}")
    return Advice(f"model {name!r} not found on this machine.", tuple(steps))


def for_error(code: int | None, message: str | None, data: Any) -> Advice:
    """An error answer (the server's, or the client's own -32099) in a person's words."""
    message = message or "the server answered with an error"
    data = data if isinstance(data, dict) else {}
    if code == MODEL_NOT_FOUND and isinstance(data.get("candidates"), list):
        names = ", ".join(map(str, data["candidates"]))
        return Advice(
            f"The name {data.get('model')!r} fits several models: {names}.",
            ("Name one of them whole (or enough of it to tell them apart).",),
        )
    if code == MODEL_NOT_FOUND and isinstance(data.get("model"), str):
        return model_not_found(data["model"], [str(n) for n in data.get("available") or []])
    if code == SERVER_GONE:
        return Advice(
            "The server (kinfer-rpc) exited before it answered.",
            ("`kinfer doctor` checks the installation; `--log-level info` shows what the server says.",),
        )
    if code == CONTEXT_OVERFLOW:
        return Advice(_sentence(message), ("A longer context: --context-length N (or /clear to start over).",))
    if code in (LOAD_FAILED, BACKEND_UNAVAILABLE):
        return Advice(_sentence(message), ("`kinfer doctor` says what this machine can run.",))
    if code == QUEUE_FULL:
        return Advice(_sentence(message), ("Try again when fewer requests are running (`kinfer ps`).",))
    return Advice(_sentence(message))


def _sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    return text[0].upper() + text[1:] + ("" if text.endswith((".", "!", "?", ")")) else ".")
