"""The README's table of environment variables is complete: every variable the code reads
(kinfer_rpc/ and the Node and Neovim clients: os.environ, os.getenv, process.env, vim.env, and
module constants that name one) is a row of it, with a default and what it does."""

from __future__ import annotations

import re

from paths import ROOT

READS = [
    r"os\.environ(?:\.get|\.setdefault|\.pop)?\(\s*[\"']([A-Z][A-Z0-9_]+)[\"']",
    r"os\.environ\[\s*[\"']([A-Z][A-Z0-9_]+)[\"']",
    r"getenv\(\s*[\"']([A-Z][A-Z0-9_]+)[\"']",
    r"[\"']([A-Z][A-Z0-9_]+)[\"']\s+(?:not\s+)?in\s+os\.environ",
    r"process\.env\.([A-Z][A-Z0-9_]+)",
    r"vim\.env\.([A-Z][A-Z0-9_]+)",
]
# A constant naming a variable, in a module that reads the environment (ENV = "KINFER_TRACE")
CONSTANT = r"^\s*[A-Z_]+\s*=\s*\"((?:KINFER|GGML|LLAMA|MLX|OLLAMA)_[A-Z0-9_]+)\""


def read_by_code() -> dict[str, set[str]]:
    files = [*(ROOT / "kinfer_rpc").rglob("*.py"), *(ROOT / "clients" / "nvim").rglob("*.lua")]
    files += [p for p in (ROOT / "clients" / "node").glob("*.js")]  # the client, not its tests
    found: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        names = {m for pattern in READS for m in re.findall(pattern, text)}
        if "os.environ" in text:
            names |= set(re.findall(CONSTANT, text, re.M))
        for name in names:
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def readme_table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Configuration and environment\n") :]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_every_variable_the_code_reads_is_in_the_readme():
    code, table = read_by_code(), readme_table()
    assert len(code) > 15, code  # the search finds them
    missing = {name: sorted(where) for name, where in code.items() if name not in table}
    assert not missing, f"variables the code reads that README.md's table lacks: {missing}"
    for name, (default, what) in table.items():
        assert default and len(what) > 10, name  # a default and what it does


def test_the_search_finds_each_way_of_reading():
    code = read_by_code()
    for name in ("KINFER_HOME", "KINFER_TRACE", "GGML_CUDA_BATCH_INVARIANT", "MLX_PTX_CACHE_DIR", "XDG_RUNTIME_DIR"):
        assert name in code, name
    assert "clients/node/index.js" in code["KINFER_RPC"]
