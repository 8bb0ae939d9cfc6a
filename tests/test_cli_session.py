"""`kinfer chat` / `kinfer run` at a terminal, as a person types at it (tmux: keys sent, the screen
read back): the /commands, multi-line messages, the history file."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import KINFER, WEATHER, write_json
from tmux_helpers import answer, at_prompt, typed, wait_until

DEFAULT = "smollm2-135m-instruct"
VERBOSE = (  # --verbose and /set verbose: Ollama's lines, then the seed and why the reply ended
    "total duration",
    "load duration",
    "prompt eval count",
    "prompt eval duration",
    "prompt eval rate",
    "eval count",
    "eval duration",
    "eval rate",
    "seed",
    "done reason",
)


def test_commands_change_what_the_chat_sends(term, fake):
    term.start(f"{fake.command} chat --temperature 0.5")
    term.wait_for(at_prompt, "the prompt")

    answer(term, "/set parameter num_predict 7", "Set parameter 'num_predict' to '7'")
    answer(term, "/set parameter stop END STOP", "Set parameter 'stop' to 'END STOP'")
    answer(term, "/set system You are terse.", "Set system message.")
    # a multi-line message: from """ to """
    typed(term, '"""line one', "line two", 'line three"""')
    wait_until(lambda: len(fake.chats()) == 1, 30, "the first chat")
    (first,) = fake.chats()
    assert first["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "line one\nline two\nline three"},
    ]
    assert first["options"] == {"temperature": 0.5, "maxTokens": 7, "stop": ["END", "STOP"]}
    term.wait_for(at_prompt, "the prompt after the reply")

    # lines pasted (the terminal marks a paste: bracketed paste) are one message, as Ollama takes them
    term("set-buffer", "Second question,\npasted on two lines")
    term("paste-buffer", "-p", "-t", "t")
    term.keys("Enter")
    wait_until(lambda: len(fake.chats()) == 2, 30, "the second chat")
    second = fake.chats()[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[-1]["content"] == "Second question,\npasted on two lines"
    term.wait_for(at_prompt, "the prompt after the reply")

    answer(term, "/clear", "Cleared session context")
    answer(term, "/set system", "Cleared system message.")
    # mistakes are said, and the chat goes on as it was
    answer(term, "/foo bar", "Unknown command '/foo'. Type /? for help")
    answer(term, "/set parameter temperature hot", "temperature must be a number, not 'hot'")
    answer(term, "/set parameter num_ctx 8192", "--context-length")
    answer(term, "/set parameter nope 1", "unknown parameter 'nope'")
    # Ctrl-C in a multi-line message drops it
    typed(term, '"""not sent', "either")
    term.wait_for(lambda s: s.splitlines()[-1] == "...", "the continuation prompt")
    term.keys("C-c")
    term.wait_for(at_prompt, "the prompt after Ctrl-C")
    typed(term, '"""Third"""')  # """ on one line
    wait_until(lambda: len(fake.chats()) == 3, 30, "the third chat")
    third = fake.chats()[2]
    assert third["messages"] == [{"role": "user", "content": "Third"}]
    assert third["options"] == first["options"]
    term.wait_for(at_prompt, "the prompt after the reply")

    shown = answer(term, "/show parameters", "Parameters set in this chat:")
    assert "temperature" in shown and "0.5" in shown and "maxTokens" in shown and '["END", "STOP"]' in shown
    answer(term, "/show system", "No system message")
    answer(term, "/set system You are a pirate.", "Set system message.")
    answer(term, "/show system", "You are a pirate.")
    answer(term, "/set parameter seed 5", "Set parameter 'seed' to '5'")
    answer(term, "/set parameter seed -1", "Set parameter 'seed' to '-1'")  # Ollama's -1: no seed
    typed(term, "/set format json", "Fourth")
    wait_until(lambda: len(fake.chats()) == 4, 30, "the fourth chat")
    fourth = fake.chats()[3]
    assert fourth["options"] == {**first["options"], "format": "json"}
    assert fourth["messages"][0]["content"] == "You are a pirate."
    assert len(fourth["messages"]) == 4  # the system message, then Third, its reply and Fourth
    term.wait_for(at_prompt, "the prompt after the reply")

    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer chat to leave")
    assert term.exit() == "0"
    assert len(fake.chats()) == 4  # the commands, the mistakes and the dropped message sent nothing
    # what was typed is kept for the next chat (the arrow keys bring it back)
    history = (Path(os.environ["KINFER_HOME"]) / "history").read_text()
    assert "/set parameter num_predict 7" in history and "Second question," in history


def test_help_lists_the_commands(term, fake):
    term.start(f"{fake.command} run fake")
    term.wait_for(at_prompt, "the prompt")
    for command in ("/?", "/help"):
        help_text = answer(term, command, "/bye")
        for line in ("/set parameter", "/set system", "/show info", "/clear", "/load", '"""'):
            assert line in help_text, help_text
    answer(term, "/set", "Available /set commands")
    answer(term, "/show", "Available /show commands")
    term.keys("C-d")
    wait_until(term.dead, 30, "kinfer to leave on Ctrl-D")
    assert term.exit() == "0" and fake.chats() == []


def test_a_server_that_exits_ends_the_chat(term, fake):
    # A question the server refuses is said and the chat goes on; a server gone ends it.
    term.start(f"{fake.command} chat")
    term.wait_for(at_prompt, "the prompt")
    typed(term, "exit now")
    wait_until(term.dead, 30, "kinfer chat to end")
    assert term.exit() == "1"
    screen = term.screen()
    assert "kinfer: The server (kinfer-rpc) exited" in screen and "-32099" not in screen, screen
    assert "Traceback" not in screen
    # asked once (piped), the same, without waiting for a server that is gone
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", f"{fake.command} chat"], input="exit now\n", capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "The server (kinfer-rpc) exited" in proc.stderr and proc.stdout == ""
    assert time.monotonic() - start < 5


def test_tool_calls_go_back_in_the_history(term, fake, tmp_path):
    tool = write_json(tmp_path, "weather.json", WEATHER)
    term.start(f"{fake.command} chat --json --tool {tool} --format json")
    time.sleep(0.5)
    term.wait_for(lambda s: s.splitlines()[-1:] == [">>>"], "the prompt")
    typed(term, "Weather?")
    wait_until(lambda: len(fake.chats()) == 1, 30, "the first chat")
    term.wait_for(lambda s: '"toolCalls"' in s and at_prompt(s), "the first reply")
    typed(term, "And now?")
    wait_until(lambda: len(fake.chats()) == 2, 30, "the second chat")
    first, second = fake.chats()
    assert first["options"]["format"] == "json"
    assert second["messages"][1] == {
        "role": "assistant",
        "content": "",
        "toolCalls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}},
            },
        ],
    }


@pytest.mark.model
def test_a_session_with_the_default_model(term):
    term.start(f"exec {KINFER} run smollm2 --threads 1 --temperature 0")
    term.wait_for(at_prompt, "the prompt")
    info = answer(term, "/show info", "architecture")
    assert DEFAULT in info and "llama" in info and "135" in info and "context length" in info, info

    # the model's reply follows what was set: 3 tokens, seed 7 (the verbose line says so)
    answer(term, "/set parameter num_predict 3", "Set parameter 'num_predict' to '3'")
    answer(term, "/set parameter seed 7", "Set parameter 'seed' to '7'")
    answer(term, "/set verbose", "Set 'verbose' mode.")
    typed(term, "Count from 1 to 100, one number per line.")
    screen = term.wait_for(lambda s: "done reason:" in s and at_prompt(s), "the reply and its timings")
    # Ollama's statistics, line by line
    stats = {}
    for line in screen.splitlines():
        key, _, value = line.partition(":")
        if key in VERBOSE:
            stats[key] = value.strip()
    assert list(stats) == list(VERBOSE), screen
    for key in ("total duration", "load duration", "prompt eval duration", "eval duration"):
        assert stats[key].endswith(("s", "ms", "µs")), stats
    assert stats["eval count"] == "3 token(s)" and stats["seed"] == "7", stats
    assert stats["prompt eval rate"].endswith("tokens/s") and stats["eval rate"].endswith("tokens/s"), stats
    assert int(stats["prompt eval count"].split()[0]) > 10, stats

    # another model; an unknown one is the server's error, and the chat goes on
    assert DEFAULT in answer(term, "/load qwen3:8b", "not found")  # the names to choose from
    answer(term, "/load smollm2-135m", f"Loaded {DEFAULT}")
    typed(term, "Name a colour.")
    screen = term.wait_for(lambda s: s.count("done reason:") == 2 and at_prompt(s), "the second reply")
    assert "Traceback" not in screen
    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer run to leave")
    assert term.exit() == "0"


@pytest.mark.model
@pytest.mark.usefixtures("pirate_store")
def test_show_tells_the_models_own_parameters_and_system(term):
    term.start(f"exec {KINFER} run pirate --threads 1")
    term.wait_for(at_prompt, "the prompt")
    shown = answer(term, "/show system", "Answer like one.")
    assert "The model's own system message:\nYou are a pirate." in shown, shown
    answer(term, "/set parameter temperature 0", "Set parameter 'temperature' to '0'")
    shown = answer(term, "/show parameters", "The model's own")
    chat, own = shown.split("The model's own (where this chat sets none):")
    assert chat.split() == ["Parameters", "set", "in", "this", "chat:", "temperature", "0.0"], chat
    own_rows = dict(line.split(None, 1) for line in own.strip().splitlines() if line.strip() != ">>>")
    assert own_rows["temperature"] == "0.2" and own_rows["maxTokens"] == "40" and own_rows["contextLength"] == "2048"
    answer(term, "/show template", "add_generation_prompt")
    answer(term, "/set system Be a parrot.", "Set system message.")
    shown = answer(term, "/show system", "Be a parrot.")
    assert "The model's own" not in shown
    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer run to leave")
    assert term.exit() == "0"
