"""The promise the way a client meets it: the same request gets the same reply whatever else runs.

Hypothesis draws mixes: the load's slot count and KV layout (prefix pool on or off), the requests
under test (greedy or seeded, held to a JSON schema or a regex or not, drafting on or off) and,
around them, other requests of other lengths arriving at other moments, some cancelled after a
few pieces. Every request under test
must come back token for token as it did alone, drafting off, on a load of another shape. All of
it goes through `kinfer-rpc` as a client spawns it.

On the CPU this runs on the embedded default model. On a GPU machine bench/gpu_e2e.sh runs it on
each shape it builds, every layer on the GPU:

    KINFER_PROMISE_MODEL=m.gguf KINFER_PROMISE_GPU_LAYERS=999 KINFER_PROMISE_EXAMPLES=12 \\
        pytest tests/test_promise.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc.client import Client

pytestmark = pytest.mark.model  # a real model, through the server

MODEL = os.environ.get("KINFER_PROMISE_MODEL")  # None: the embedded default
GPU_LAYERS = int(os.environ.get("KINFER_PROMISE_GPU_LAYERS", "0"))
EXAMPLES = int(os.environ.get("KINFER_PROMISE_EXAMPLES", "4"))
TOKENS = 24  # each request under test generates this many tokens (ignoring end of text)
CONTEXT = int(os.environ.get("KINFER_PROMISE_CONTEXT", "512"))  # a slot's; a byte-level vocabulary needs more

# Prompts of 4 to about 250 tokens; a request under test is one of these, greedy or seeded.
_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge its form".split()
PROMPTS = [
    "Name a colour.",
    "Write one sentence about the sea.",
    "List three uses of a paperclip: " + " ".join(_WORDS[:9]),
    "Summarise: " + " ".join(_WORDS * 3),
    "def add(a, b):\n    return a + b\n\n# now write a function that multiplies three numbers\n",
    "Continue the story. " + " ".join(_WORDS[i % len(_WORDS)] for i in range(170)),
]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
}
MODES = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 1234},
    # held to a JSON schema (greedy) and to a regex (seeded): masks must not depend on neighbours
    "schema": {"temperature": 0.0, "format": SCHEMA},
    "regex": {"temperature": 0.8, "seed": 77, "regex": "[a-z]+( [a-z]+)*[.]"},
}


def _options(mode: str, drafting: bool) -> dict[str, Any]:
    return {"maxTokens": TOKENS, "ignoreEos": True, "draftPolicy": "ngram" if drafting else "none", **MODES[mode]}


class Server:
    """One kinfer-rpc for the module (the thread-safe client), its load changed per example."""

    def __init__(self) -> None:
        self.client = Client()
        self.loaded: tuple[int, int] | None = None
        self.name = ""

    def load(self, slots: int, prefix: int) -> str:
        if self.loaded != (slots, prefix):
            if self.loaded is not None:
                self.client.unload(self.name)
            options = {"slots": slots, "prefix": prefix, "contextLength": CONTEXT, "gpuLayers": GPU_LAYERS}
            self.name, self.loaded = self.client.load(MODEL, **options).model, (slots, prefix)
        return self.name


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    assert s.client.close() == 0


@pytest.fixture(scope="module")
def alone(server: Server) -> dict[tuple[int, str], list[int]]:
    """Each request under test alone on a one-slot load without the prefix pool, drafting off."""
    name = server.load(1, -1)
    return {
        (i, mode): server.client.generate(prompt, name, **_options(mode, False)).tokens
        for i, prompt in enumerate(PROMPTS)
        for mode in MODES
    }


under_test = st.tuples(
    st.integers(0, len(PROMPTS) - 1), st.sampled_from(sorted(MODES)), st.booleans(), st.integers(0, 40)
)  # prompt, mode, drafting, delay in ms
other = st.tuples(
    st.integers(0, 250), st.integers(1, 48), st.integers(0, 60), st.one_of(st.none(), st.integers(1, 6))
)  # prompt words, tokens, delay in ms, cancelled after this many pieces (None: runs to its end)
mixes = st.fixed_dictionaries(
    {
        "slots": st.sampled_from([2, 4, 16]),
        "prefix": st.sampled_from([-1, 4096]),
        "tests": st.lists(under_test, min_size=1, max_size=4),
        "others": st.lists(other, min_size=0, max_size=12),
    }
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mix=mixes)
def test_a_reply_is_the_same_whatever_else_runs(server: Server, alone: dict, mix: dict) -> None:
    name = server.load(mix["slots"], mix["prefix"])
    got: dict[int, list[int]] = {}

    def ask_under_test(k: int, prompt: int, mode: str, drafting: bool, delay: int) -> None:
        time.sleep(delay / 1000)
        got[k] = server.client.generate(PROMPTS[prompt], name, **_options(mode, drafting)).tokens

    def ask_other(k: int, words: int, tokens: int, delay: int, cancel_after: int | None) -> None:
        time.sleep(delay / 1000)
        prompt = f"Other request {k}: " + " ".join(_WORDS[(k + i) % len(_WORDS)] for i in range(words))
        with server.client.stream_generate(prompt, name, maxTokens=tokens, temperature=0.7, seed=k) as stream:
            for pieces, _ in enumerate(stream, 1):
                if cancel_after is not None and pieces >= cancel_after:
                    stream.cancel()
                    break

    with ThreadPoolExecutor(len(mix["tests"]) + len(mix["others"])) as pool:
        futures = [pool.submit(ask_other, k, *o) for k, o in enumerate(mix["others"])]
        futures += [pool.submit(ask_under_test, k, *t) for k, t in enumerate(mix["tests"])]
        for f in futures:
            f.result()
    for k, (prompt, mode, drafting, _) in enumerate(mix["tests"]):
        expected = alone[(prompt, mode)]
        first = next((t for t, (a, b) in enumerate(zip(expected, got[k])) if a != b), None)
        assert got[k] == expected, (
            f"request {k} (prompt {prompt}, {mode}, drafting {'on' if drafting else 'off'}) differs from its "
            f"lone reply at token {first} on slots {mix['slots']}, prefix {mix['prefix']}"
        )
