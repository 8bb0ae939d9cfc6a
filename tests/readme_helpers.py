"""The README and docs/cli.md as the tests read them: their code blocks."""

from __future__ import annotations

import re
from pathlib import Path

from paths import ROOT

README = ROOT / "README.md"


CLI_DOC = ROOT / "docs" / "cli.md"


NODE_CLIENT = ROOT / "clients" / "node"


FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


PULL = re.compile(r"`kinfer pull ([a-z0-9][a-z0-9.:/_-]*)`")  # a name, not a placeholder (NAME)


def blocks(lang: str, section: str | None = None, doc: Path = README) -> list[str]:
    text = doc.read_text()
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end != -1 else None]
    return [code for tag, code in FENCE.findall(text) if tag == lang]


def pulls_before(code: str) -> list[str]:
    """The `kinfer pull NAME` lines the README's text says an example needs: in the paragraphs
    between the block before it and the block itself."""
    text = README.read_text()
    at = text.index(code)
    previous = text.rfind("```", 0, text.rfind("```", 0, at))
    return PULL.findall(text[max(previous, 0) : at])
