"""The `llm` plugin (kinfer_rpc.integrations.llm_kinfer) as users run it: the `llm` command and
llm's Python API in processes of their own, the plugin loaded through llm's entry point group
(LLM_LOAD_PLUGINS=kinfer-rpc keeps other installed plugins out), LLM_USER_PATH a temporary folder.

kinfer's stores are temporary too, with the embedded model and its copy whose chat template takes
tools (tests/modelgen/make_tool_model.py) as `smollm2-tools`. Most prompts run on a daemon (`kinfer
serve`), which the plugin finds on its socket and attaches to, as it would a user's; one runs
without, on a kinfer-rpc of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from paths import ROOT
from plugin_helpers import entry_points_path
from served import Served

LLM = str(Path(sys.executable).parent / "llm")
MODEL = "kinfer/smollm2-135m-instruct"
TOOLS_MODEL = "kinfer/smollm2-tools"
WEATHER = 'def get_weather(city: str) -> str:\n    "The weather now in a city."\n    return f"sunny in {city}"\n'


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    from make_tool_model import make_tool_model

    home = tmp_path_factory.mktemp("llm-plugin")
    (home / "models").mkdir()
    make_tool_model(home / "models" / "smollm2-tools.gguf")
    from make_think_model import make_think_model

    make_think_model(home / "models" / "smollm2-think.gguf")
    return home


def llm_env(home: Path, tmp: Path, kinfer_home: Path | None = None) -> dict[str, str]:
    """The environment of an `llm` command; KINFER_HOME (default: the daemon's) says where the
    plugin looks for the daemon's socket."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(
        KINFER_HOME=str(kinfer_home or home / "kinfer"),
        KINFER_MODELS=str(home / "models"),
        OLLAMA_MODELS=str(home / "ollama"),
        LLM_USER_PATH=str(tmp / "llm"),
        LLM_LOAD_PLUGINS="kinfer-rpc",
        OMP_WAIT_POLICY="PASSIVE",
    )
    paths = [entry_points_path(tmp / "site"), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


@pytest.fixture
def env(home, tmp_path) -> dict[str, str]:
    return llm_env(home, tmp_path)


@pytest.fixture(scope="module")
def daemon(home, tmp_path_factory):
    """`kinfer serve` on the socket the plugin looks for (KINFER_HOME/run/kinfer.sock)."""
    env = llm_env(home, tmp_path_factory.mktemp("daemon"))
    (home / "kinfer").mkdir()
    s = Served(home / "kinfer", env={k: env[k] for k in ("KINFER_MODELS", "OLLAMA_MODELS", "OMP_WAIT_POLICY")})
    try:
        yield s
    finally:
        assert s.stop() == 0


def llm(env: dict[str, str], *args: str, stderr: bool = False) -> str:
    """What `llm ARGS` prints (on stdout; and on stderr, where --td writes, with `stderr`)."""
    proc = subprocess.run([LLM, *args], env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"llm {' '.join(args)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout + (proc.stderr if stderr else "")


def last_log(env: dict[str, str]) -> dict:
    return json.loads(llm(env, "logs", "-n", "1", "--json"))[0]


def test_llm_models_lists_kinfers_models_with_their_options(env):
    listed = llm(env, "models")
    assert f"KinferModel: {MODEL}" in listed and f"KinferModel: {TOOLS_MODEL}" in listed
    options = llm(env, "models", "--options", "-m", MODEL)
    for name in ("temperature", "max_tokens", "seed", "stop", "tool_choice", "json_object"):
        assert f"{name}:" in options


@pytest.mark.model
def test_a_prompt_without_a_daemon_runs_on_a_kinfer_rpc_of_its_own(home, tmp_path):
    env = llm_env(home, tmp_path, kinfer_home=tmp_path / "kinfer")  # no daemon's socket there
    out = llm(env, "-m", MODEL, "Say hi", "-o", "temperature", "0", "-o", "max_tokens", "8")
    assert out.strip()
    log = last_log(env)
    assert log["model"] == MODEL and 0 < log["output_tokens"] <= 8 and log["input_tokens"] > 0
    assert log["response_json"]["stopReason"] in ("stop", "length")


@pytest.mark.model
def test_prompts_reach_the_daemon_and_are_seeded(daemon, env):
    args = ("-m", MODEL, "Name a colour.", "-o", "temperature", "0.9", "-o", "seed", "7", "-o", "max_tokens", "12")
    first, second = llm(env, *args), llm(env, *args)
    assert first == second and first.strip()
    loaded = [m for m in daemon.status() if m["model"] == MODEL.removeprefix("kinfer/")]
    assert loaded and loaded[0]["state"] == "ready"  # the plugin attached to the daemon: loaded there
    details = json.loads(last_log(env)["token_details"])  # llm keeps it as JSON text
    assert details["cached_tokens"] > 0  # the daemon's prefix cache served the second


@pytest.mark.model
def test_a_schema_holds_the_answer(daemon, env):
    out = llm(env, "-m", MODEL, "--schema", "name, age int", "Make up a person.", "-o", "temperature", "0")
    person = json.loads(out)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)


@pytest.mark.model
def test_a_forced_tool_call_runs_the_tool_and_its_result_goes_back(daemon, env):
    out = llm(
        env,
        "-m",
        TOOLS_MODEL,
        "--functions",
        WEATHER,
        "What is the weather in Paris?",
        "-o",
        "tool_choice",
        "get_weather",
        "-o",
        "parallel_tool_calls",
        "false",
        "-o",
        "max_tokens",
        "40",
        "--td",
        stderr=True,
    )
    assert "Tool call: get_weather({'city': " in out and "sunny in" in out
    calls, answer = json.loads(llm(env, "logs", "-n", "2", "--json"))
    (call,) = calls["tool_calls"]
    assert call["name"] == "get_weather" and set(call["arguments"]) == {"city"}  # held to the schema
    (result,) = answer["tool_results"]
    assert result["tool_call_id"] == call["tool_call_id"] and result["output"].startswith("sunny in")


PYTHON_API = """
import asyncio, json
import llm
from pydantic import BaseModel

model = llm.get_model("kinfer/smollm2-135m-instruct")
out = {}
r = model.prompt("Say hi", temperature=0, max_tokens=8)
out["text"], out["usage"] = r.text(), [r.usage().input, r.usage().output]
out["chunks"] = list(model.prompt("Say hi", temperature=0, max_tokens=8))
conversation = model.conversation()
conversation.prompt("My name is Ada.", temperature=0, max_tokens=8).text()
second = conversation.prompt("What is my name?", temperature=0, max_tokens=8)
second.text()
out["history"] = [m.role for m in second.prompt.messages]

class Person(BaseModel):
    name: str
    age: int

out["person"] = json.loads(model.prompt("Make up a person.", schema=Person, temperature=0).text())

def get_weather(city: str) -> str:
    "The weather now in a city."
    return f"sunny in {city}"

tools = llm.get_model("kinfer/smollm2-tools")
chain = tools.chain(
    "What is the weather in Paris?", tools=[get_weather],
    options={"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 30, "temperature": 0},
)
chain.text()
out["calls"] = [[c.name, c.arguments] for r in chain.responses() for c in r.tool_calls()]

async def main():
    amodel = llm.get_async_model("kinfer/smollm2-135m-instruct")
    text = await amodel.prompt("Say hi", temperature=0, max_tokens=8).text()
    chunks = [c async for c in amodel.prompt("Say hi", temperature=0, max_tokens=8)]
    return text, chunks

out["async"] = asyncio.run(main())
print(json.dumps(out))
"""


@pytest.mark.model
def test_llms_python_api(daemon, env, tmp_path):
    script = tmp_path / "api.py"
    script.write_text(textwrap.dedent(PYTHON_API))
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] and 0 < out["usage"][1] <= 8 and out["usage"][0] > 0
    assert "".join(out["chunks"]) == out["text"] and len(out["chunks"]) > 1  # streamed, token by token
    assert out["history"] == ["user", "assistant", "user"]  # the conversation went to the model
    assert set(out["person"]) == {"name", "age"} and isinstance(out["person"]["age"], int)
    (call,) = out["calls"]
    assert call[0] == "get_weather" and set(call[1]) == {"city"}
    text, chunks = out["async"]
    assert text == out["text"] and "".join(chunks) == text


@pytest.mark.model
def test_a_thinking_models_reasoning_is_a_reasoning_part(daemon, env):
    args = ["-o", "think", "true", "-o", "max_reasoning_tokens", "6", "-o", "temperature", "0"]
    args += ["-o", "max_tokens", "120"]
    out = llm(env, "-m", "kinfer/smollm2-think", "--schema", "name, country", "Name a city.", *args)
    assert set(json.loads(out)) == {"name", "country"}  # the schema holds the answer, after the reasoning
    log = last_log(env)
    assert log["reasoning"] and log["reasoning"] not in out
    assert json.loads(log["token_details"])["reasoning_tokens"] == 7


def test_an_image_attachment_is_the_messages_image(tmp_path):
    import llm
    from llm.parts import AttachmentPart, Message, TextPart

    from kinfer_rpc.integrations.llm_kinfer import kinfer_messages

    shot = tmp_path / "shot.png"
    shot.write_bytes(b"\x89PNG\r\n\x1a\n")
    parts = [TextPart("What is it?"), AttachmentPart(llm.Attachment(path=str(shot)))]
    parts.append(AttachmentPart(llm.Attachment(content=b"GIF89a")))
    assert kinfer_messages([Message("user", parts)]) == [
        {"role": "user", "content": "What is it?", "images": [str(shot), "R0lGODlh"]}
    ]
    with pytest.raises(ValueError, match="URL"):
        kinfer_messages([Message("user", [AttachmentPart(llm.Attachment(url="https://x/y.png"))])])
