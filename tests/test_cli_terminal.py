"""`kinfer` in a terminal of 80 columns, as a person reads it (tmux: keys sent, the screen read
back as the terminal shows it): replies wrapped at words, tables and help that fit, the closest
spelling of a misspelt /command or parameter, /save and /load, and shell completion."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import BIN, DEFAULT, FAKE_SERVER, KINFER
from tmux_helpers import answer, at_prompt, typed, wait_until


def reply_lines(screen: str, question: str) -> list[str]:
    """The lines of the last reply to `question`, as the terminal shows them."""
    after = screen.rsplit(f">>> {question}\n", 1)[1]
    return after.split("\n>>>", 1)[0].splitlines()


def test_replies_wrap_at_words(term, fake):  # noqa: F811

    long_text = FAKE_SERVER.split("LONG = (", 1)[1].split(") * 3", 1)[0]
    words = "".join(part.strip().strip('"') for part in long_text.splitlines()).split() * 3
    term.start(f"{fake.command} chat", width=80)
    term.wait_for(at_prompt, "the prompt")
    screen = answer(term, "Why is the sky blue?", "sky.", 30)
    lines = reply_lines(term.screen(joined=False), "Why is the sky blue?")
    assert len(lines) > 3 and all(len(line) <= 80 for line in lines), lines
    assert " ".join(lines).split() == words, lines  # no word was cut at the edge
    # /set nowordwrap: the terminal cuts where it must (Ollama's /set nowordwrap)
    answer(term, "/set nowordwrap", "Set 'nowordwrap' mode.")
    answer(term, "Why is the sky blue?", "sky.", 30)
    lines = reply_lines(term.screen(joined=False), "Why is the sky blue?")
    assert " ".join(lines).split() != words, lines  # a word was cut at the edge
    assert reply_lines(term.screen(), "Why is the sky blue?")[0].split() == words  # one line, wrapped by tmux
    answer(term, "/set wordwrap", "Set 'wordwrap' mode.")
    assert "Traceback" not in screen


def test_help_and_tables_fit_80_columns(term, fake, tmp_path):  # noqa: F811
    term.start(f"{fake.command} chat", width=80)
    term.wait_for(at_prompt, "the prompt")
    for command in ("/?", "/set", "/show", "/set parameter"):
        answer(term, command, "\n>>>" if command != "/?" else '"""')
    shown = term.screen(joined=False)
    assert shown == term.screen(joined=True), "a line was wrapped by the terminal"
    assert max(len(line) for line in shown.splitlines()) <= 80
    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer chat to leave")
    for command in ("list", "ps"):
        term.restart(f"exec {KINFER} {command}", width=80)
        wait_until(term.dead, 60, f"kinfer {command}")
        assert term.exit() == "0"
        shown, joined = (
            [line for line in term.screen(joined=j).splitlines() if line and not line.startswith("Pane is dead")]
            for j in (False, True)
        )
        assert shown == joined and max(len(line) for line in shown) <= 80, shown  # nothing wrapped
        assert command != "list" or DEFAULT in shown[1]


def test_a_misspelt_command_or_parameter_gets_the_closest(term, fake):  # noqa: F811
    term.start(f"{fake.command} chat", width=80)
    term.wait_for(at_prompt, "the prompt")
    said = answer(term, "/set parameter tempurature 0.5", "Did you mean 'temperature'?")
    assert "num_predict" in said and "top_k" in said  # the names /? shows
    answer(term, "/sav x", "Did you mean '/save'?")
    answer(term, "/set wordwarp", "Did you mean 'wordwrap'")
    # Ollama's spellings and kinfer's both set an option
    answer(term, "/set parameter top_k 20", "Set parameter 'top_k' to '20'")
    answer(term, "/set parameter topP 0.9", "Set parameter 'topP' to '0.9'")
    answer(term, "/set parameter num_predict 7", "Set parameter 'num_predict' to '7'")
    typed(term, "Hello")
    wait_until(lambda: len(fake.chats()) == 1, 30, "the chat")
    assert fake.chats()[0]["options"] == {"topK": 20, "topP": 0.9, "maxTokens": 7}


def test_save_and_load_a_conversation(term, fake, tmp_path):  # noqa: F811
    term.start(f"{fake.command} chat", width=80)
    term.wait_for(at_prompt, "the prompt")
    answer(term, "/set system Be brief.", "Set system message.")
    answer(term, "/set parameter temperature 0.2", "Set parameter")
    answer(term, "Why is the sky blue?", "sky.", 30)
    answer(term, "/save sky", "Saved the conversation (2 messages) as 'sky'")
    answer(term, "/save ../escape", "not a conversation's name")
    saved = Path(os.environ["KINFER_HOME"]) / "conversations" / "sky.json"
    assert saved.stat().st_mode & 0o777 == 0o600 and not (tmp_path / "home" / "escape.json").exists()
    assert json.loads(saved.read_text())["messages"][0] == {"role": "user", "content": "Why is the sky blue?"}
    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer chat to leave")

    # another chat, later: /load brings the conversation back, and the next question goes with it
    term.restart(f"{fake.command} chat", width=80)
    term.wait_for(at_prompt, "the prompt")
    answer(term, "/load sky", "Loaded the conversation 'sky' (2 messages")
    typed(term, "And at night?")
    wait_until(lambda: len(fake.chats()) == 2, 30, "the chat after /load")
    after = fake.chats()[1]
    assert [m["role"] for m in after["messages"]] == ["system", "user", "assistant", "user"]
    assert after["messages"][0]["content"] == "Be brief." and after["options"] == {"temperature": 0.2}
    term.wait_for(at_prompt, "the prompt after the reply")
    answer(term, "/load", "sky")  # alone: what can be loaded


@pytest.mark.model
def test_the_default_model_wraps_and_a_saved_conversation_goes_on(term):  # noqa: F811
    """The same, with the real server and the embedded model: a long reply wrapped at words in 80
    columns, saved, and carried on in another chat."""
    term.start(f"exec {KINFER} run smollm2 --threads 1 --temperature 0", width=80)
    term.wait_for(at_prompt, "the prompt")
    answer(term, "/set parameter num_predict 80", "Set parameter 'num_predict' to '80'")
    question = "Write a long paragraph about the sea."
    answer(term, question, "", 120)
    lines = reply_lines(term.screen(joined=False), question)
    assert len([line for line in lines if line.strip()]) > 2, lines  # long enough to wrap
    assert term.screen(joined=False) == term.screen(joined=True), "the terminal cut a line"
    assert all(len(line) <= 80 for line in lines), lines
    answer(term, "/save sea", "Saved the conversation (2 messages) as 'sea'")
    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer run to leave")
    saved = json.loads((Path(os.environ["KINFER_HOME"]) / "conversations" / "sea.json").read_text())
    said = saved["messages"][1]
    assert said["role"] == "assistant" and " ".join(said["content"].split()) == " ".join(" ".join(lines).split())

    term.restart(f"exec {KINFER} run smollm2 --threads 1 --temperature 0", width=80)
    term.wait_for(at_prompt, "the prompt")
    answer(term, "/load sea", "Loaded the conversation 'sea' (2 messages")
    answer(term, "/set parameter num_predict 8", "Set parameter")
    answer(term, "Say it in one line.", "", 120)
    answer(term, "/save sea2", "Saved the conversation (4 messages) as 'sea2'")
    assert "Traceback" not in term.screen()
    typed(term, "/bye")
    wait_until(term.dead, 30, "kinfer run to leave")


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion(term, shell, monkeypatch):  # noqa: F811
    binary = shutil.which(shell)
    if binary is None:
        pytest.skip(f"{shell} is not installed")
    prompt = "kinfer-test> "
    start = {
        "bash": f"env PS1='{prompt}' {binary} --norc --noprofile",
        "zsh": f"env PS1='{prompt}' {binary} -f",
        "fish": f"{binary} --no-config -C \"function fish_prompt; echo -n '{prompt}'; end\"",
    }[shell]
    load = {
        "bash": "source <(kinfer completion bash)",
        "zsh": "autoload -U compinit && compinit -u && source <(kinfer completion zsh)",
        "fish": "kinfer completion fish | source",
    }[shell]
    monkeypatch.setenv("PATH", BIN + os.pathsep + os.environ["PATH"])  # kinfer on PATH, as in an activated venv
    term.start(start, width=100)
    term.wait_for(lambda s: s.endswith(prompt.strip()), "the shell's prompt", 30)
    typed(term, load)
    term.wait_for(lambda s: s.count(prompt.strip()) >= 2 and s.endswith(prompt.strip()), "the script loaded", 30)

    def complete(text: str, expected: str) -> None:
        term.keys("-l", "--", text)
        term.keys("Tab")
        term.wait_for(lambda s: expected in s.splitlines()[-1], repr(expected), 30)

    complete("kinfer ch", "kinfer chat")
    complete("--temp", "kinfer chat --temperature")
    complete("0 -m smol", f"-m {DEFAULT}")
    complete(" -o num_pr", "-o num_predict")
    term.keys("C-c")
    complete("kinfer completion z", "kinfer completion zsh")
    term.keys("C-c")
    typed(term, "exit")
