"""The `kinfer` command's terminal helpers (kinfer_rpc/terminal/), without a server: word wrap,
tables that fit, option names, did-you-mean, the config file, saved conversations and the
completion scripts' syntax in each shell."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from kinfer_rpc.cli import build_parser
from kinfer_rpc.terminal import advice, columns, config, conversations
from kinfer_rpc.terminal import options as request_options
from kinfer_rpc.terminal.completion import script
from kinfer_rpc.terminal.wrap import WordWrap

TEXT = (
    "The sky is blue because molecules in the air scatter blue light from the sun more than red light.\n"
    "    indented lines keep their indentation\n"
    "A word longer than the line: https://example.com/a/very/long/address/that/goes/on/and/on end."
)


def wrapped(text: str, width: int, seed: int = 0) -> str:
    out: list[str] = []
    wrap = WordWrap(out.append, width)
    rng = random.Random(seed)
    i = 0
    while i < len(text):  # pieces cut anywhere, as tokens are
        n = rng.randint(1, 6)
        wrap.write(text[i : i + n])
        i += n
    wrap.end()
    return "".join(out)


@pytest.mark.parametrize("seed", range(5))
def test_word_wrap_never_cuts_a_word(seed):
    width = 30
    text = wrapped(TEXT, width, seed)
    assert text.split() == TEXT.split()  # every word, whole and in order
    for line in text.splitlines():
        if "https://" not in line:
            assert len(line) <= width - 1, line  # the last column stays free
    assert "\n    indented lines" in text  # a line's own indentation stays
    assert not any(line.endswith(" ") for line in text.splitlines())


def test_word_wrap_after_a_word_the_terminal_cut():
    out: list[str] = []
    wrap = WordWrap(out.append, 20)
    wrap.write("x" * 40 + " next words")  # the terminal cuts the long word after 20 and 40 cells
    wrap.end()
    assert "".join(out) == "x" * 40 + "next words"  # no blank at the start of the terminal's line


def test_word_wrap_counts_cells():
    text = wrapped("漢字 " * 20, 20)
    from rich.cells import cell_len

    assert all(cell_len(line) <= 20 for line in text.splitlines())


def test_a_table_fits_by_eliding_one_column():
    rows = [["smollm2-135m-instruct", "98.4 MB", "/home/someone/.kinfer/models/blobs/sha256-" + "a" * 64]]
    lines = columns.fit(["NAME", "SIZE", "PATH"], rows, 60, elastic=2, right={1})
    assert all(len(line) <= 60 for line in lines) and "..." in lines[1] and lines[1].endswith("a" * 10)
    assert lines[1].startswith("smollm2-135m-instruct  98.4 MB  /home")
    lines = columns.fit(["NAME", "SIZE", "PATH"], rows, 40, elastic=2)  # too little room: left out
    assert lines[0].split() == ["NAME", "SIZE"]
    assert columns.fit(["NAME", "SIZE", "PATH"], rows, None, elastic=2)[1].endswith(rows[0][2])  # --wide
    lines = columns.fit(["NAME", "MODELS"], [["x", "a (1/4 busy), b (0/4 busy)"]], 10, 1, drop=False, middle=False)
    assert lines[1] == "x     a (1/4 bu..." and columns.home_short(os.path.expanduser("~/x")) == "~/x"


def test_options_by_any_spelling():
    for name in ("num_predict", "max_tokens", "maxTokens"):
        assert request_options.parse(name, ["9"]) == ("maxTokens", 9)
    assert request_options.parse("top_k", ["20"]) == request_options.parse("topK", ["20"]) == ("topK", 20)
    assert request_options.parse("stop", ["a", "b"]) == ("stop", ["a", "b"])
    assert request_options.parse("seed", ["-1"])[1] is request_options.UNSET
    with pytest.raises(request_options.OptionError, match="Did you mean 'temperature'") as e:
        request_options.parse("tempurature", ["1"])
    assert "num_predict" in str(e.value) and "top_k" in str(e.value)  # the names /? shows
    with pytest.raises(request_options.OptionError, match="--context-length"):
        request_options.parse("num_ctx", ["8192"])
    assert request_options.from_value("stop", "END") == ("stop", ["END"])
    with pytest.raises(request_options.OptionError, match="an integer"):
        request_options.from_value("top_k", True)


def test_closest_names():
    assert advice.closest("smolm2", ["smollm2-135m-instruct", "tiny-a"]) == ["smollm2-135m-instruct"]
    assert advice.closest("qwen3:8b", ["qwen3:0.6b", "tiny-a"]) == ["qwen3:0.6b"]
    assert advice.closest("lst", ["chat", "run", "list", "ps"]) == ["list"]
    assert advice.closest("zzz", ["chat", "run"]) == []
    said = advice.for_error(-31001, "model 'x' not found", {"model": "qwen3", "available": ["qwen3:0.6b"]})
    assert said.steps[0] == "Did you mean qwen3:0.6b?" and said.steps[-1] == "To download it: kinfer pull qwen3"
    assert "-31001" not in said.text() and said.json(-31001)["error"]["code"] == -31001
    path = advice.for_error(-31001, "", {"model": "./m.gguf", "available": []})
    assert not any("pull" in s for s in path.steps)  # a path is not pulled
    wrapped_text = advice.Advice("word " * 30, ("step " * 30,)).text(40, "kinfer: ")
    assert all(len(line) <= 40 for line in wrapped_text.splitlines())


def test_config_file(tmp_path):
    file = tmp_path / "config.toml"
    assert config.read(file) == config.Config(file)  # none: nothing set
    file.write_text(
        'model = "qwen3:0.6b"\nlog_level = "info"\nwordwrap = false\ncontext_length = 4096\n'
        '[options]\ntemperature = 0.5\nnum_predict = 64\ntop_k = 20\nstop = "END"\nseed = -1\n'
    )
    cfg = config.read(file)
    assert (cfg.model, cfg.log_level, cfg.wordwrap, cfg.context_length) == ("qwen3:0.6b", "info", False, 4096)
    assert cfg.options == {"temperature": 0.5, "maxTokens": 64, "topK": 20, "stop": ["END"]}
    for text, words in (
        ("modle = 'x'\n", ["modle", "Did you mean 'model'"]),
        ("temperature = 1\n", ["temperature", "[options]"]),
        ("threads = 'four'\n", ["threads", "an integer"]),
        ("log_level = 'loud'\n", ["log_level", "debug, info, warning, error"]),
        ("[options]\ntemprature = 1\n", ["options.temprature", "Did you mean 'temperature'"]),
        ("[options]\ntop_k = 1.5\n", ["options.top_k", "an integer"]),
        ("model = \n", ["not valid TOML", "line 1"]),
    ):
        file.write_text(text)
        with pytest.raises(config.ConfigError) as e:
            config.read(file)
        assert str(file) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_conversations_are_kept_safely(tmp_path, monkeypatch):
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    kept = conversations.Conversation("m", "Be brief.", {"temperature": 0}, [{"role": "user", "content": "Hi"}])
    path = conversations.save("first-try_1.0", kept)
    assert conversations.load("first-try_1.0") == kept and conversations.names() == ["first-try_1.0"]
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["first-try_1.0.json"]  # no temporary file left
    for bad in ("../x", "a/b", ".hidden", "", "x" * 65, "qwen3:8b", "a\\b", "é"):
        assert not conversations.valid(bad)
        with pytest.raises(conversations.ConversationError, match="not a conversation's name"):
            conversations.save(bad, kept)
    # a file that is a link is not followed: replaced when saving, refused when loading
    outside = tmp_path / "outside.json"
    outside.write_text("keep me")
    (path.parent / "linked.json").symlink_to(outside)
    with pytest.raises(conversations.ConversationError, match="cannot read"):
        conversations.load("linked")
    conversations.save("linked", kept)
    assert outside.read_text() == "keep me" and not (path.parent / "linked.json").is_symlink()
    # nor is a folder that is a link
    shutil.rmtree(path.parent)
    (tmp_path / "elsewhere").mkdir()
    path.parent.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(conversations.ConversationError, match="symbolic link"):
        conversations.save("x", kept)
    assert list((tmp_path / "elsewhere").iterdir()) == [] and conversations.names() == []
    path.parent.unlink()
    path.parent.mkdir()
    (path.parent / "broken.json").write_text('{"version": 1, "model": 3}')
    with pytest.raises(conversations.ConversationError, match="not a saved conversation"):
        conversations.load("broken")


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_parse(shell):
    binary = shutil.which(shell)
    if binary is None:
        pytest.skip(f"{shell} is not installed")
    parser, _ = build_parser()
    text = script(shell, parser, list(request_options.SHOWN.values()))
    flag = "-l max-tokens" if shell == "fish" else "--max-tokens"
    for word in ("chat", "run", "list", "pull", flag, "num_predict", "completion --models"):
        assert word in text, word
    check = [binary, "-n"] if shell != "fish" else [binary, "--no-execute"]
    proc = subprocess.run([*check], input=text, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
