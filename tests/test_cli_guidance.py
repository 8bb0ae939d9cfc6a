"""`kinfer` as a newcomer meets it: the help when typed alone, the closest spelling of a misspelt
command, option or parameter, the next step after an error (in words, and as JSON with --json),
the config file, the log level passed to the server, `run -m`, and the completion scripts."""

from __future__ import annotations

import json
import subprocess

import pytest
from cli_helpers import DEFAULT, kinfer, kinfer_fails


def usage_error(*args: str) -> subprocess.CompletedProcess:
    proc = kinfer_fails(*args)
    assert proc.returncode == 2, (args, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc


def test_kinfer_alone_prints_the_help():
    proc = kinfer()
    assert proc.stdout.startswith("usage: kinfer") and "chat" in proc.stdout and "completion" in proc.stdout
    assert proc.stderr == ""


def test_a_misspelt_command_or_option_gets_the_closest():
    assert "unknown command 'lst'. Did you mean 'list'?" in usage_error("lst").stderr
    assert "Did you mean 'run'?" in usage_error("rn", "smollm2").stderr
    proc = usage_error("chat", "--temprature", "0", "hi")
    assert "--temprature" in proc.stderr and "Did you mean '--temperature'?" in proc.stderr, proc.stderr
    proc = usage_error("chat", "-o", "tempurature", "1", "hi")
    assert "Did you mean 'temperature'?" in proc.stderr and "num_predict" in proc.stderr, proc.stderr
    # --json: the error is a JSON document on stdout as well
    proc = usage_error("--json", "lst")
    assert "Did you mean 'list'?" in json.loads(proc.stdout)["error"]["message"]
    proc = usage_error("list", "--json", "--wdie")
    assert "--wide" in json.loads(proc.stdout)["error"]["message"]


def test_run_takes_the_model_first_or_by_option(fake_server):  # noqa: F811
    kinfer("run", "-m", "fake", "Name a colour.")
    kinfer("run", "fake", "--max-tokens", "3", "Name", "a", "colour.")  # the words are the prompt, as Ollama joins them
    kinfer("run", "--model", "fake", "Name a colour.", "--seed", "2")
    chats = fake_server()
    assert [c["model"] for c in chats] == ["fake"] * 3
    assert all(c["messages"] == [{"role": "user", "content": "Name a colour."}] for c in chats), chats
    assert "which model?" in usage_error("run").stderr


def test_the_server_logs_at_the_level_asked(fake_server, tmp_path, monkeypatch):  # noqa: F811
    argv = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_ARGV", str(argv))
    kinfer("chat", "Name a colour.")
    assert json.loads(argv.read_text())[:2] == ["--log-level", "error"]  # llama.cpp's warnings kept out
    kinfer("--log-level", "info", "chat", "Name a colour.")
    assert json.loads(argv.read_text())[:2] == ["--log-level", "info"]
    kinfer("chat", "--log-level", "debug", "Name a colour.")
    assert json.loads(argv.read_text())[:2] == ["--log-level", "debug"]


def test_the_config_file_sets_defaults(fake_server, tmp_path, monkeypatch):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("KINFER_HOME", str(home))
    argv = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_ARGV", str(argv))
    (home / "config.toml").write_text(
        'log_level = "warning"\n[options]\ntemperature = 0.3\nnum_predict = 64\nstop = ["END"]\n'
    )
    kinfer("chat", "Name a colour.")
    assert fake_server()[-1]["options"] == {"temperature": 0.3, "maxTokens": 64, "stop": ["END"]}
    assert json.loads(argv.read_text())[:2] == ["--log-level", "warning"]
    kinfer("chat", "Name a colour.", "--temperature", "0", "-o", "stop", "X")  # the command line wins
    assert fake_server()[-1]["options"] == {"temperature": 0, "maxTokens": 64, "stop": ["X"]}
    # a bad file is an error naming the file and the key, the same for every command that reads it
    (home / "config.toml").write_text("[options]\ntemprature = 0.3\n")
    for args in (["chat", "hi"], ["list"]):
        proc = kinfer_fails(*args)
        assert proc.returncode == 2 and "config.toml: options.temprature" in proc.stderr, proc.stderr
        assert "Did you mean 'temperature'?" in proc.stderr
    proc = kinfer_fails("--json", "list")
    assert "options.temprature" in json.loads(proc.stdout)["error"]["message"]


def test_rm_says_what_it_can_delete(small_store):  # noqa: F811
    proc = kinfer_fails("rm", DEFAULT)
    assert "embedded default model" in proc.stderr and "cannot be deleted" in proc.stderr, proc.stderr
    assert "`kinfer list`" not in proc.stderr
    proc = kinfer_fails("--json", "rm", "tiny-a")  # a file in kinfer's folder, not a pulled model
    error = json.loads(proc.stdout)["error"]
    assert "not a model it pulled" in error["message"] and "none yet" in error["steps"][-1]
    proc = kinfer_fails("rm", "tiny-c")
    assert "no model that `kinfer pull` downloaded is named 'tiny-c'" in proc.stderr, proc.stderr


def test_show_an_unknown_model_says_the_next_step(small_store):  # noqa: F811
    proc = kinfer_fails("show", "tiny-c")
    assert proc.returncode == 1 and "Did you mean tiny-a or tiny-b?" in proc.stderr, proc.stderr
    assert "kinfer pull tiny-c" in proc.stderr and "(-31001)" not in proc.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts(shell):
    text = kinfer("completion", shell).stdout
    assert "kinfer completion --models" in text and "chat" in text
    names = kinfer("completion", "--models").stdout.split()
    assert DEFAULT in names
    assert "which shell?" in usage_error("completion").stderr


def test_word_wrap_off_a_terminal_keeps_the_text(fake_server):  # noqa: F811
    # Piped: the reply as the model wrote it, one line (a terminal's is tests/test_cli_session.py's)
    text = kinfer("chat", "Why is the sky blue?").stdout
    assert text.count("\n") == 1 and len(text) > 300
