"""`kinfer run` with a thinking model (SmolLM2 with Qwen3's template and `<think>` tokens,
tests/modelgen/make_think_model.py): `--think`, `--json`'s reasoning, and at a terminal (tmux)
the reasoning dimmed as it streams, folded into one line once the answer begins, `/show
thinking`, `/set think`, `/set nothink`."""

from __future__ import annotations

import json

import pytest
from cli_helpers import KINFER, kinfer
from make_think_model import make_think_model
from tmux_helpers import answer, at_prompt, typed

from kinfer_rpc.terminal import thinking

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_think_model(tmp_path_factory.mktemp("think") / "smollm2-think.gguf"))


def test_think_value_words():
    assert [thinking.think_value(w) for w in ("true", "False", "HIGH", "low")] == [True, False, "high", "low"]
    with pytest.raises(ValueError):
        thinking.think_value("max")


def test_json_has_the_reasoning_apart_and_piped_output_the_answer_alone(model):
    opts = ["--threads", "1", "--temperature", "0", "-o", "max_reasoning_tokens", "6", "--max-tokens", "40"]
    out = json.loads(kinfer("run", model, "--think", "--json", *opts, "--format", "json", "Name a city.").stdout)
    assert out["reasoning"] and out["usage"]["reasoningTokens"] == 7
    assert out["text"].startswith("{")
    plain = kinfer("run", model, "--think=low", *opts, "Name a city.").stdout
    assert out["reasoning"] not in plain  # piped: the answer alone
    off = json.loads(kinfer("run", model, "--think=false", "--json", *opts, "Name a city.").stdout)
    assert "reasoning" not in off and off["usage"]["reasoningTokens"] == 0


def test_bad_think_is_an_argument_error():
    import subprocess

    proc = subprocess.run([KINFER, "run", "x", "--think=max", "q"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "think is true, false, low, medium or high" in proc.stderr


def test_at_a_terminal_the_reasoning_is_dimmed_then_folded(term, model):  # noqa: F811
    term.start(f"exec {KINFER} run {model} --threads 1 --temperature 0 -o max_reasoning_tokens 24", width=80)
    term.wait_for(at_prompt, "the prompt")
    answer(term, "/set parameter num_predict 40", "Set parameter")
    shown = answer(term, "Name a city in Europe.", "Thought for", 120)
    assert "Thinking..." not in shown  # folded once the answer began
    assert "(/show thinking)" in shown
    reasoning = answer(term, "/show thinking", "")
    assert len(reasoning.strip()) > 10
    raw = term("capture-pane", "-p", "-e", "-t", "t", "-S", "-200")
    assert "\x1b[2m" in raw  # dim
    answer(term, "/set nothink", "Set 'nothink' mode.")
    after = answer(term, "Another one?", "", 120)
    assert "Thought for" not in after
    answer(term, "/set think high", "Set 'think' mode to 'high'.")
    answer(term, "/show parameters", "Thinking: high")
    answer(term, "/set think maybe", "/set think: think is true")
    typed(term, "/bye")
