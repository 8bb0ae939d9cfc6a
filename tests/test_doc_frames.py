"""Every example frame in the docs has the Content-Length of its body: a client written from the
README or the spec must frame messages the way the examples show."""

from __future__ import annotations

import glob
import os
import re

import pytest
from paths import ROOT

DOCS = sorted(
    {
        os.path.relpath(p, ROOT)
        for pattern in ("*.md", "spec/*.md", "docs/*.md", "clients/*/README.md", "patches/*.md")
        for p in glob.glob(os.path.join(ROOT, pattern))
    }
)
# A header line as the docs write it (with \r\n spelt out), the blank line, then the body's line.
FRAME = re.compile(r"^[ \t]*Content-Length: (\d+)\\r\\n[ \t]*\n[ \t]*\\r\\n[ \t]*\n[ \t]*(.+?)[ \t]*$", re.M)


def frames(path: str) -> list[tuple[int, str]]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [(int(n), body) for n, body in FRAME.findall(f.read())]


def test_the_docs_have_example_frames():
    found = {path: frames(path) for path in DOCS}
    assert found["README.md"] and found[os.path.join("spec", "specification.md")]


@pytest.mark.parametrize("path", DOCS)
def test_every_example_frame_has_its_bodys_length(path):
    for length, body in frames(path):
        assert length == len(body.encode("utf-8")), (
            f"{path}: Content-Length {length} for a {len(body.encode())}-byte body: {body}"
        )
