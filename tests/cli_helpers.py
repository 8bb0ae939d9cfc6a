"""What the tests of the `kinfer` command share: running it, and a stand-in server that answers
every chat with tool calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


KINFER = os.path.join(BIN, "kinfer")


DEFAULT = "smollm2-135m-instruct"


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see tests/test_client.py
    e.pop("NO_COLOR", None)
    e.pop("FORCE_COLOR", None)
    return e


def kinfer(*args, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [KINFER, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"kinfer {' '.join(args)}: {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert "\x1b[" not in proc.stdout + proc.stderr, "colours when not on a terminal"
    return proc


def json_lines(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# -- naming the model: -m, `kinfer run NAME`, and the server's word on the name --------------------
def kinfer_fails(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [KINFER, *args], capture_output=True, text=True, env=env(), timeout=120, stdin=subprocess.DEVNULL
    )
    assert proc.returncode != 0, f"kinfer {' '.join(args)} did not fail\nstdout:\n{proc.stdout}"
    return proc


# -- agents: --format, --tool, --tool-choice -----------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# A stand-in for kinfer-rpc that answers every chat with two tool calls, and writes the params
# of each inference/chat it gets to $FAKE_LOG: the CLI's side of tools, without a model.
FAKE_SERVER = r"""
import json, os, sys

def read():
    length = None
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            sys.exit(0)
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return json.loads(sys.stdin.buffer.read(length))

def send(message):
    body = json.dumps(message).encode()
    sys.stdout.buffer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    sys.stdout.buffer.flush()

CALLS = [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
]
LONG = ("The sky looks blue because the air scatters the blue part of sunlight much more than the red part, "
        "so blue light reaches your eyes from every direction of the sky. ") * 3
MODEL = {"model": "fake", "backend": "fake", "path": "/fake", "source": "path"}
if os.environ.get("FAKE_ARGV"):
    with open(os.environ["FAKE_ARGV"], "w") as f:
        json.dump(sys.argv[1:], f)
while True:
    m = read()
    method, rid, params = m.get("method"), m.get("id"), m.get("params") or {}
    if rid is None:
        if method == "exit":
            sys.exit(0)
        continue
    result = None
    if method == "initialize":
        result = {"serverInfo": {"name": "kinfer-rpc", "version": "0"}, "protocolVersion": 1, "capabilities": {}}
    elif method == "model/list":
        result = {"models": []}
    elif method == "model/load":
        result = MODEL
    elif method == "inference/chat":
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(json.dumps(params) + "\n")
        if params["messages"][-1]["content"] == "exit now":  # a server that dies mid-chat
            sys.exit(3)
        token = params.get("partialResultToken")
        if params["messages"][-1]["content"] == "Why is the sky blue?":  # a long text, streamed
            for i in range(0, len(LONG), 7):  # pieces that cut words, as tokens do
                value = {"text": LONG[i : i + 7], "tokens": [1]}
                send({"jsonrpc": "2.0", "method": "$/progress", "params": {"token": token, "value": value}})
            result = {"model": "fake", "text": LONG, "tokens": [1], "stopReason": "stop", "seed": 1,
                      "usage": {"promptTokens": 1, "completionTokens": 1}, "timings": {}}
            send({"jsonrpc": "2.0", "id": rid, "result": result})
            continue
        if token is not None:
            value = {"text": "", "tokens": [1], "toolCalls": CALLS}
            send({"jsonrpc": "2.0", "method": "$/progress", "params": {"token": token, "value": value}})
        result = {"model": "fake", "text": "", "tokens": [1], "stopReason": "toolCalls", "seed": 1,
                  "usage": {"promptTokens": 1, "completionTokens": 1}, "timings": {}, "toolCalls": CALLS}
    send({"jsonrpc": "2.0", "id": rid, "result": result})
"""


def write_json(tmp_path, name, obj) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)
