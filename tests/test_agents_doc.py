"""docs/agents.md's examples, run as they are written, against one `kinfer serve --http` on a free
port: the ```python blocks with this interpreter, the ```sh block with bash (this virtualenv's bin
first on PATH).

The examples read $KINFER_BASE_URL (the daemon's OpenAI face) and $KINFER_TOOLS_MODEL, here the
embedded model's copy with a chat template that takes tools (tests/modelgen/make_tool_model.py) in
the daemon's model folder; the adapters' examples find the daemon on its socket (KINFER_HOME) and
attach to it. A 135M model does not reason: what is asserted is what the wiring guarantees, that
the requests reached kinfer (its engine stepped) and that the answer came back typed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from paths import ROOT
from plugin_helpers import entry_points_path
from served import Served

pytestmark = pytest.mark.model

DOC = ROOT / "docs" / "agents.md"
BIN = os.path.dirname(sys.executable)
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
TOOLS_MODEL = "smollm2-tools"

# What each section's example must print: the calls made and the typed answer its framework parsed
WEATHER = r"Weather\(city='[^']*', summary='[^']*'\)"
CALL = r"'get_weather', \{'city': '[^']*'\}"
ANSWERS = {
    "pydantic-ai": WEATHER,
    "OpenAI Agents SDK": WEATHER,
    "smolagents": r"\('final_answer', \{'answer': ",
    "LangChain: `ChatKinfer`": r"'name': 'get_weather', 'args': \{'city': '[^']*'\}[\s\S]*" + WEATHER,
    "llm: `llm -m kinfer/NAME`": rf"\({CALL}\)[\s\S]*\{{'city': '[^']*', 'summary': '[^']*'\}}",
}


def examples() -> list[tuple[str, str, str]]:
    """(section, language, code) of every python and sh block, by the ### or ## heading above it."""
    text = DOC.read_text()
    found = []
    for m in FENCE.finditer(text):
        headings = re.findall(r"^#{2,3} (.+)$", text[: m.start()], re.M)
        if m.group(1) in ("python", "sh"):
            found.append((headings[-1], m.group(1), m.group(2)))
    return found


def test_every_section_has_its_example():
    sections = {section for section, _, _ in examples()}
    assert sections == set(ANSWERS) | {"Through the HTTP face"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from make_tool_model import make_tool_model

    home = tmp_path_factory.mktemp("agents-doc")
    (home / "models").mkdir()
    make_tool_model(home / "models" / f"{TOOLS_MODEL}.gguf")
    s = Served(home)
    try:
        yield s
    finally:
        assert s.stop() == 0


def steps(served: Served) -> int:
    return sum(m.get("steps", 0) for m in served.status())


@pytest.mark.parametrize(
    "section,lang,code",
    [pytest.param(*e, id=f"{e[0].split(':')[0].split()[0].lower()}-{e[1]}") for e in examples() if e[0] in ANSWERS],
)
def test_example(served, section, lang, code, tmp_path):
    env = {**served.env, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    env.update(
        KINFER_BASE_URL=served.url + "/v1",
        KINFER_TOOLS_MODEL=TOOLS_MODEL,
        LLM_USER_PATH=str(tmp_path / "llm"),
        LLM_LOAD_PLUGINS="kinfer-rpc",
        OMP_WAIT_POLICY="PASSIVE",
    )
    paths = [entry_points_path(tmp_path / "site"), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    script = tmp_path / ("example.py" if lang == "python" else "example.sh")
    script.write_text(code)
    before = steps(served)
    command = [sys.executable, str(script)] if lang == "python" else ["bash", "-euo", "pipefail", str(script)]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert steps(served) > before  # the requests reached kinfer
    if lang == "sh":
        assert f"kinfer/{TOOLS_MODEL}" in proc.stdout and "Tool call: llm_time(" in proc.stdout + proc.stderr
    else:
        assert re.search(ANSWERS[section], proc.stdout), proc.stdout
