"""The `kinfer` command, run as a person or a script would: chat, list, ps, doctor, bench."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
from pathlib import Path

import pytest
from cli_helpers import DEFAULT, KINFER, WEATHER, env, json_lines, kinfer, kinfer_fails, write_json
from store_helpers import MEDIA, OllamaStore, place

from kinfer_rpc.cli.chat import _call_text
from kinfer_rpc.client import Client, ToolCall
from kinfer_rpc.host.store import embedded_default_path


@pytest.mark.model
def test_chat_with_a_prompt():
    greedy = ["--max-tokens", "8", "--threads", "1", "--temperature", "0"]
    proc = kinfer("chat", "Name a colour.", *greedy)  # the embedded default model
    assert proc.stdout.strip()
    # or the model named (a unique prefix names it): -m, or first as `kinfer run` takes it
    assert kinfer("chat", "-m", "smollm2", "Name a colour.", *greedy).stdout == proc.stdout
    assert kinfer("run", "smollm2", "Name a colour.", *greedy).stdout == proc.stdout


@pytest.mark.model
def test_chat_json_output_parses():
    (a,) = json_lines(
        kinfer("--json", "chat", "Name a colour.", "--max-tokens", "6", "--threads", "1", "--seed", "3").stdout
    )
    (b,) = json_lines(
        kinfer("chat", "--json", "Name a colour.", "--max-tokens", "6", "--threads", "1", "--seed", "3").stdout
    )
    assert a["model"] == DEFAULT and a["text"] and a["usage"]["completionTokens"] <= 6
    assert a["seed"] == b["seed"] == 3
    assert a["text"] == b["text"]


@pytest.mark.model
def test_piped_stdin_is_the_question():
    # `echo question | kinfer run NAME`: the reply, only it, then the end (the interactive chat,
    # its /commands and history are tests/test_cli_session.py's, at a terminal)
    greedy = ["--max-tokens", "8", "--threads", "1", "--temperature", "0"]
    piped = kinfer("run", "smollm2", *greedy, stdin="Name a colour.\n")
    assert piped.stdout.strip() and piped.stdout == kinfer("chat", "Name a colour.", *greedy).stdout
    assert piped.stderr == ""


def test_list():
    # the columns a person needs (at a terminal they fit its width: tests/test_cli_terminal.py);
    # --wide: every column
    proc = kinfer("list")
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["NAME", "SOURCE", "SIZE", "PARAMS", "QUANT", "CONTEXT", "NUM_CTX", "PATH"]
    assert any(row.startswith(DEFAULT) and "embedded" in row for row in rows)
    models = json.loads(kinfer("list", "--json").stdout)
    assert any(m["name"] == DEFAULT and m["source"] == "embedded" for m in models)
    header, *rows = kinfer("list", "--wide").stdout.splitlines()
    assert header.split() == [
        *("NAME", "SOURCE", "FORMAT", "SIZE", "ARCH", "PARAMS", "QUANT", "CONTEXT", "NUM_CTX", "PATH")
    ]
    (mine,) = [m for m in models if m["name"] == DEFAULT]
    assert any(row.endswith(mine["path"]) for row in rows)


@pytest.mark.model
def test_ps_shows_the_servers_of_this_machine():
    with Client() as client:
        client.load(threads=1)
        servers = json.loads(kinfer("ps", "--json").stdout)
        mine = [s for s in servers if s["pid"] == client.pid]
        assert mine, servers
        (server,) = mine
        assert server["ppid"] == os.getpid() and server["clientProcessId"] == os.getpid()
        assert [m["name"] for m in server["models"]] == [DEFAULT]
        assert server["rssBytes"] > 0
        text = kinfer("ps").stdout
        assert any(line.split()[0] == str(client.pid) and DEFAULT in line for line in text.splitlines()[1:])
    servers = json.loads(kinfer("ps", "--json").stdout)
    assert client.pid not in [s["pid"] for s in servers]


@pytest.mark.model
def test_doctor_json():
    report = json.loads(kinfer("doctor", "--json").stdout)
    assert report["ok"] is True, report["problems"]
    assert "llama" in report["backends"]
    assert report["plugins"] and report["brokenPlugins"] == []
    assert report["defaultModel"]["name"] == DEFAULT and report["defaultModel"]["sizeBytes"] > 0
    assert os.path.exists(report["defaultModel"]["path"])
    assert report["memory"]["totalBytes"] > 0 and report["memory"]["availableBytes"] > 0
    assert isinstance(report["devices"], list) and isinstance(report["gpus"], list)
    assert report["error"] is not None or any(d["type"] == "cpu" for d in report["devices"])
    assert report["loadCheck"]["ok"] is True
    assert isinstance(report["vision"]["available"], bool)  # libmtmd beside libllama: images read


def test_doctor_text():
    out = kinfer("doctor", "--no-load").stdout
    labels = [line.split()[0] for line in out.splitlines() if line.strip()]
    for label in ("backends", "gpu", "memory", "default", "images"):
        assert label in labels, out
    assert DEFAULT in out


@pytest.mark.model
def test_bench_with_tiny_settings():
    report = json.loads(kinfer("bench", "--json", "-n", "3", "-c", "2", "--max-tokens", "4", "--threads", "1").stdout)
    assert report["requests"] == 3 and report["concurrency"] == 2
    assert report["completionTokens"] == 12  # end of text is ignored: every request makes all its tokens
    assert report["tokensPerSecond"] > 0 and report["perRequest"]["ttftMsMean"] > 0
    out = kinfer("bench", "-n", "2", "-c", "2", "--max-tokens", "2", "--threads", "1").stdout
    assert "tok/s" in out


def test_colours_on_a_terminal_only():
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [KINFER, "list"], stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env(), timeout=60
        )
        os.close(slave)
        slave = None
        data = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    assert proc.returncode == 0
    assert b"\x1b[" in data and DEFAULT.encode() in data


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "-n", "0"],
        ["chat", "--max-tokens", "x"],
        ["run"],
        ["chat", "-o", "nope", "1"],
        ["chat", "-o", "temperature", "hot"],
        ["chat", "-o", "top_k", "1.5"],
        ["run", "x", "-o", "num_ctx", "8192"],
        ["chat", "-o", "seed"],
    ],
)
def test_bad_arguments_fail(args):
    proc = subprocess.run(
        [KINFER, *args], capture_output=True, text=True, env=env(), timeout=60, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2
    if "-o" in args:
        assert "-o" in proc.stderr, proc.stderr


def test_an_unknown_model_is_an_error_with_the_names_to_choose_from(small_store):
    # Never another model answering: the server resolves the name and says why it cannot.
    # Said in words, with what to do next: the pull line, the models here; no bare code.
    for args in (
        ["run", "qwen3:8b", "Name a colour."],
        ["run", "qwen3:8b"],  # interactive
        ["run", "-m", "qwen3:8b", "Name a colour."],
        ["chat", "-m", "qwen3:8b", "Name a colour."],
    ):
        proc = kinfer_fails(*args)
        assert proc.returncode == 1 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        assert "model 'qwen3:8b' not found" in proc.stderr and "-31001" not in proc.stderr, proc.stderr
        assert "kinfer pull qwen3:8b" in proc.stderr, proc.stderr
        for name in (DEFAULT, "tiny-a", "tiny-b"):
            assert name in proc.stderr.split("The models here:", 1)[1], proc.stderr
    # --json: the same as a JSON document on stdout, with the code and the server's data
    proc = kinfer_fails("chat", "--json", "--model", "qwen3:8b", "Name a colour.")
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == -31001 and error["data"]["model"] == "qwen3:8b"
    assert "kinfer pull qwen3:8b" in error["steps"][-1] and "not found" in error["message"]
    # a misspelt name: the closest one (difflib), not the whole list
    proc = kinfer_fails("run", "tiny-c", "Name a colour.")
    assert "Did you mean tiny-a or tiny-b?" in proc.stderr, proc.stderr
    proc = kinfer_fails("run", "tiny", "Name a colour.")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "several models" in proc.stderr and "tiny-a" in proc.stderr and "tiny-b" in proc.stderr, proc.stderr


def test_chat_takes_one_prompt_and_the_model_by_option():
    # `kinfer chat NAME PROMPT` (the model first) is refused with the spellings that name a model.
    proc = kinfer_fails("chat", "qwen3:8b", "Name a colour.")
    assert proc.returncode == 2 and "-m NAME" in proc.stderr and "kinfer run" in proc.stderr, proc.stderr
    proc = kinfer_fails("run")
    assert proc.returncode == 2 and "NAME" in proc.stderr, proc.stderr


# -- options: only those given are sent, so a model's own parameters apply -------------------------
def test_chat_sends_only_the_options_given(fake_server):
    kinfer("chat", "Name a colour.")
    assert "options" not in fake_server()[-1]  # no maxTokens, no temperature: the model's own apply
    kinfer("run", "fake", "Name a colour.", "--temperature", "0.5")
    assert fake_server()[-1]["options"] == {"temperature": 0.5}
    kinfer("chat", "--max-tokens", "7", "--seed", "3", "--temperature", "0", stdin="Name a colour.\n")
    assert fake_server()[-1]["options"] == {"maxTokens": 7, "seed": 3, "temperature": 0}


@pytest.mark.model
def test_an_ollama_models_parameters_apply_unless_given(tmp_path, monkeypatch):
    """An Ollama model whose params layer sets num_predict 3 and seed 42: kinfer's replies have
    3 tokens (the server applies the model's defaults under a request's options), unless
    --max-tokens says otherwise."""
    gguf = Path(embedded_default_path())
    store = OllamaStore(tmp_path / "ollama")
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    place(gguf, store.root / "blobs" / digest.replace(":", "-"))
    model = {"mediaType": MEDIA + "model", "digest": digest, "size": gguf.stat().st_size}
    params = store.blob(json.dumps({"num_predict": 3, "seed": 42, "temperature": 0}).encode(), "params")
    store.manifest("registry.ollama.ai/library/counter/latest", [model, params])
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    monkeypatch.setenv("KINFER_MODELS", str(tmp_path / "kinfer"))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    prompt = "Count from 1 to 100, one number per line."
    (three,) = json_lines(kinfer("run", "counter", prompt, "--json", "--threads", "1").stdout)
    assert three["model"] == "counter:latest"
    assert (three["usage"]["completionTokens"], three["stopReason"], three["seed"]) == (3, "length", 42)
    # the same reply for a person (the model's temperature 0 and seed 42)
    assert kinfer("run", "counter", prompt, "--threads", "1").stdout.strip() == three["text"].strip()
    (five,) = json_lines(
        kinfer("chat", "-m", "counter", prompt, "--json", "--threads", "1", "--max-tokens", "5").stdout
    )
    assert (five["usage"]["completionTokens"], five["stopReason"]) == (5, "length")


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_chat_prints_tool_calls(tmp_path, fake_server):
    tool = write_json(tmp_path, "weather.json", WEATHER)
    both = write_json(tmp_path, "both.json", [WEATHER, {**WEATHER, "function": {"name": "get_time"}}])
    proc = kinfer("chat", "Weather in Paris?", "--tool", tool, "--tool", both, "--tool-choice", "required")
    assert proc.stdout.splitlines() == ['get_weather(city="Paris")', 'get_weather(city="Zürich", days=2)']
    (params,) = fake_server()
    assert params["tools"] == [WEATHER, WEATHER, {**WEATHER, "function": {"name": "get_time"}}]
    assert params["toolChoice"] == "required" and "tools" not in params.get("options", {})
    # --json: the reply's document carries the calls as the protocol has them
    (doc,) = json_lines(kinfer("chat", "--json", "Weather?", "--tool", tool).stdout)
    assert doc["stopReason"] == "toolCalls" and [c["function"]["arguments"] for c in doc["toolCalls"]] == [
        {"city": "Paris"},
        {"city": "Zürich", "days": 2},
    ]
    assert "toolChoice" not in fake_server()[-1]


def test_piped_stdin_joins_the_prompt(fake_server):
    # All of stdin is one question (lines and all), before the prompt, as Ollama and llm join them.
    kinfer("run", "fake", stdin="def f():\n    return 1\n\n/bye\n")
    (params,) = fake_server()
    assert params["messages"] == [{"role": "user", "content": "def f():\n    return 1\n\n/bye"}]
    kinfer("chat", "Explain.", "--system", "Be brief.", stdin="x = 1\n")
    assert fake_server()[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "x = 1\n\nExplain."},
    ]
    kinfer("chat", "Explain.", stdin="")  # nothing piped: the prompt alone
    assert fake_server()[-1]["messages"] == [{"role": "user", "content": "Explain."}]
    kinfer("chat", stdin=" \n")  # nothing to ask: no chat
    assert len(fake_server()) == 3


def test_o_sets_any_request_option(fake_server):
    kinfer(
        "chat",
        "Name a colour.",
        *("-o", "top_k", "20", "-o", "num_predict", "9", "--option", "repeatPenalty", "1.1"),
        *("-o", "stop", "END", "-o", "stop", "STOP", "-o", "ignore_eos", "true", "--seed", "4"),
    )
    assert fake_server()[-1]["options"] == {
        "seed": 4,
        "topK": 20,
        "maxTokens": 9,
        "repeatPenalty": 1.1,
        "stop": ["END", "STOP"],
        "ignoreEos": True,
    }
    kinfer("run", "fake", "Name a colour.", "--max-tokens", "5", "-o", "max_tokens", "6")  # the last one says
    assert fake_server()[-1]["options"] == {"maxTokens": 6}
    # Ollama's -1: num_predict without a limit, no seed (the model's own, or a random one)
    kinfer("chat", "Name a colour.", "--seed", "3", "-o", "seed", "-1", "-o", "num_predict", "-1")
    assert fake_server()[-1]["options"] == {"maxTokens": 2**31 - 1}


def test_bad_format_and_tool_files_fail(tmp_path):
    not_json = tmp_path / "x.json"
    not_json.write_text("{nope")
    for args in (
        ["--format", str(tmp_path / "missing.json")],
        ["--format", str(not_json)],
        ["--format", write_json(tmp_path, "list.json", [1])],
        ["--tool", str(tmp_path / "missing.json")],
        ["--tool", write_json(tmp_path, "number.json", 3)],
        ["--tool", write_json(tmp_path, "empty.json", [])],
    ):
        proc = subprocess.run(
            [KINFER, "chat", "hi", *args],
            capture_output=True,
            text=True,
            env=env(),
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert "--format" in proc.stderr or "--tool" in proc.stderr, proc.stderr


@pytest.mark.model
def test_chat_format_holds_the_reply(tmp_path):
    schema = write_json(tmp_path, "city.json", CITY)
    args = ["--max-tokens", "60", "--threads", "1", "--temperature", "0"]
    (doc,) = json_lines(
        kinfer("chat", "--json", "A city to visit and for how many days?", "--format", schema, *args).stdout
    )
    assert doc["stopReason"] == "stop" and set(json.loads(doc["text"])) == {"city", "days"}
    text = kinfer("chat", "A city to visit and for how many days?", "--format", schema, *args).stdout
    assert json.loads(text) == json.loads(doc["text"])  # the same reply, streamed to a person


@pytest.mark.model
def test_chat_tools_need_a_template_with_tools(tmp_path):
    # SmolLM2's template has no tools: kinfer says so (exit 1), it does not print a reply.
    tool = write_json(tmp_path, "weather.json", WEATHER)
    proc = subprocess.run(
        [KINFER, "chat", "Weather in Paris?", "--tool", tool, "--max-tokens", "8", "--threads", "1"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1 and "does not support tools" in proc.stderr, proc.stderr


@pytest.mark.model
def test_chat_prints_the_calls_of_a_model_with_tools(tmp_path):
    from make_tool_model import make_tool_model

    model = make_tool_model(tmp_path / "smollm2-tools.gguf")
    tool = write_json(tmp_path, "weather.json", WEATHER)
    args = ["-m", model, "What is the weather in Paris?", "--tool", tool, "--tool-choice", "required"]
    args += ["--max-tokens", "80", "--threads", "1", "--temperature", "0"]
    lines = kinfer("chat", *args).stdout.splitlines()
    assert lines and all(line.startswith('get_weather(city="') for line in lines), lines
    (doc,) = json_lines(kinfer("chat", "--json", *args).stdout)
    assert doc["stopReason"] == "toolCalls"
    assert [_call_text(ToolCall.from_json(c)) for c in doc["toolCalls"]] == lines  # the same reply


def test_show_a_model(pirate_store):
    text = kinfer("show", "pirate").stdout
    rows = {line.strip().split("  ")[0]: line.strip() for line in text.splitlines() if line.strip()}
    assert "pirate:latest" in rows["name"] and "llama" in rows["architecture"] and "Q4_1" in rows["quantization"]
    assert "8192" in rows["context length"] and "576" in rows["embedding length"] and "ollama" in rows["source"]
    # the model's own parameters, kinfer's names; the one with no equivalent, and why
    assert "2048" in rows["contextLength"] and "0.2" in rows["temperature"] and "40" in rows["maxTokens"]
    assert "ignored" in rows["mirostat"]
    assert "Jinja" in rows["chats render with"] and "not run" in rows["Ollama's template"]
    assert "You are a pirate." in text and "Answer like one." in text
    assert kinfer("show", "pirate", "--system").stdout == "You are a pirate.\nAnswer like one.\n"
    params = dict(line.split(None, 1) for line in kinfer("show", "pir", "--parameters").stdout.splitlines())
    assert json.loads(params["contextLength"]) == 2048 and json.loads(params["stop"]) == ["<|im_end|>"]
    assert kinfer("show", "pirate", "--template").stdout.startswith("{% for message in messages %}")
    doc = json.loads(kinfer("show", "--json", "pirate").stdout)
    assert doc["name"] == "pirate:latest" and doc["parameters"] > 100_000_000 and doc["system"].startswith("You")
    assert doc["defaults"]["contextLength"] == 2048 and doc["defaults"]["temperature"] == 0.2
    assert doc["ignoredParameters"] == [{"name": "mirostat", "reason": "kinfer has no equivalent"}]
    assert doc["ollamaTemplate"] == "{{ .System }}{{ .Prompt }}" and "im_start" in doc["chatTemplate"]
    # the embedded model has none of its own
    doc = json.loads(kinfer("show", "--json", DEFAULT).stdout)
    assert doc["defaults"] == {} and doc["system"] is None and doc["source"] == "embedded"


def test_show_an_unknown_model_fails(pirate_store):
    proc = kinfer_fails("show", "qwen3:8b")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "model 'qwen3:8b' not found" in proc.stderr and "pirate:latest" in proc.stderr, proc.stderr


def test_list_shows_the_context_a_model_sets(pirate_store):
    header, *rows = kinfer("list", "--wide").stdout.splitlines()
    assert header.split()[-2:] == ["NUM_CTX", "PATH"]
    values = {row.split()[0]: row.split()[-2] for row in rows}  # (a size is two words)
    assert values == {DEFAULT: "-", "pirate:latest": "2048"}
    models = {m["name"]: m for m in json.loads(kinfer("list", "--json").stdout)}
    assert models["pirate:latest"]["numCtx"] == 2048 and "numCtx" not in models[DEFAULT]


def test_doctor_says_where_things_come_from(pirate_store, monkeypatch, tmp_path):
    # a plugin installed from a package (one that registers nothing)
    site = tmp_path / "site"
    (site / "kinfer_quiet-1.2.dist-info").mkdir(parents=True)
    (site / "kinfer_quiet-1.2.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kinfer-quiet\nVersion: 1.2\n"
    )
    (site / "kinfer_quiet-1.2.dist-info" / "entry_points.txt").write_text("[kinfer_rpc]\nquiet = kinfer_quiet\n")
    (site / "kinfer_quiet.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    report = json.loads(kinfer("doctor", "--json", "--no-load").stdout)
    assert report["stores"]["ollama"] == {"path": os.environ["OLLAMA_MODELS"], "exists": True, "models": 1}
    assert report["stores"]["kinfer"] == {"path": os.environ["KINFER_MODELS"], "exists": False, "models": 0}
    assert report["stores"]["home"]["path"] == os.environ["KINFER_HOME"]
    origins = {p["name"]: p["from"] for p in report["plugins"]}
    assert origins["llama"] == "kinfer_rpc.default_plugins.llama (built in)", origins
    assert origins["quiet"] == "kinfer_quiet (kinfer-quiet 1.2)", origins
    # the libllama loaded, and whether it carries kinfer's patches (a function they add)
    lib = report["libllama"]
    assert os.path.basename(lib["path"]).startswith("libllama.so")
    assert lib["patched"] == (b"llama_set_output_argmax" in Path(lib["path"]).read_bytes())
    if os.environ.get("LLAMA_CPP_LIB_PATH"):  # kinfer's build (tests/conftest.py), where it was built
        assert lib["from"] == "LLAMA_CPP_LIB_PATH" and lib["patched"] is True
        assert Path(lib["path"]).parent == Path(os.environ["LLAMA_CPP_LIB_PATH"]).resolve()
        monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
        lib = json.loads(kinfer("doctor", "--json", "--no-load").stdout)["libllama"]
    assert lib["from"] == "the llama-cpp-python wheel" and "llama_cpp" in lib["path"]
    text = kinfer("doctor", "--no-load").stdout
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert lib["path"] in lines["libllama"] and "llama-cpp-python wheel" in lines["libllama"]
    assert "(1 model(s))" in text and "from kinfer_rpc.default_plugins.llama (built in)" in lines["plugins"]
