"""Fill-in-the-middle through the protocol (`inference/infill`, `inference/generate` with a suffix)
on a copy of the embedded model with FIM tokens (tests/modelgen/make_fim_model.py).

The prompt is checked token for token against llama.cpp's server's `format_infill`, written again
here from its documented order, the parts tokenized by the server's own `inference/tokenize`: the
reply to `inference/generate` of those tokens must be the infill's reply, token for token."""

from __future__ import annotations

import json

import pytest
from make_fim_model import FIM_IDS, make_fim_model
from protocol_fixtures import server, spawn  # noqa: F401
from rpcclient import RpcError

from kinfer_rpc.engine.text import TextStream
from kinfer_rpc.host import infill

pytestmark = pytest.mark.model

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"
UTIL = ("util.py", "def sub(a, b):\n    return a - b\n")
GREEDY = {"temperature": 0, "maxTokens": 12}


@pytest.fixture(scope="module")
def fim_path(tmp_path_factory):
    return make_fim_model(tmp_path_factory.mktemp("fim") / "fim.gguf")


@pytest.fixture
def fim(server, fim_path):
    server.call("model/load", {"model": fim_path, "options": {"contextLength": 1024, "slots": 4, "batch": 256}})
    server.fim_path = fim_path
    return server


def tokens(c, text):
    """`text` tokenized as format_infill tokenizes its parts: no BOS, special spellings plain."""
    if not text:
        return []
    return c.call("inference/tokenize", {"text": text, "addSpecial": False, "parseSpecial": False})["tokens"]


def format_infill(c, prefix, suffix, extra, *, n_batch, n_ctx, n_predict, spm=False, middle=None):
    """llama.cpp's server's format_infill (tools/server/utils.hpp), no prompt: repository and file
    separator tokens, then the tail of the extra context, then the prefix's last 3/4 of a batch
    and the suffix's first 1/4 - 2 between the FIM tokens, suffix first with `spm`. (The model adds
    no BOS.) Differences, kinfer's: a prefix over its budget keeps its tokens from a multiple of
    1/8 of the budget on (infill.window_start), not exactly its last 3/4 of a batch; a `middle`
    (here within its budget) follows [FIM_MID], its 1/8 of a batch taken from the prefix's."""
    ids = FIM_IDS
    rep = 4  # llama.cpp's repository token in SmolLM2's vocabulary: <reponame>
    extra_tokens = [rep, *tokens(c, "myproject\n")]
    for name, text in extra:
        extra_tokens += [ids["sep"], *tokens(c, name + "\n"), *tokens(c, text)]
    extra_tokens += [ids["sep"], *tokens(c, "filename\n")]
    pre, suf = tokens(c, prefix), tokens(c, suffix)
    mid = tokens(c, middle) if middle else []
    n_prefix = len(pre) - infill.window_start(
        len(pre), 3 * (n_batch // 4) - (n_batch // 8 if middle is not None else 0)
    )
    n_suffix = min(len(suf), max(0, n_batch // 4 - 2))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    pre, suf = pre[len(pre) - n_prefix :], suf[:n_suffix]
    kept = extra_tokens[len(extra_tokens) - n_extra :]
    if spm:
        return [*kept, ids["suf"], *suf, ids["pre"], *pre, ids["mid"], *mid]
    return [*kept, ids["pre"], *pre, ids["suf"], *suf, ids["mid"], *mid]


def test_the_embedded_model_has_no_fim_tokens_so_infill_is_32602(server):
    with pytest.raises(RpcError) as e:
        server.call("inference/infill", {"prefix": PREFIX, "suffix": SUFFIX})
    assert e.value.code == -32602
    assert "cannot fill in the middle" in e.value.message and "fim_pre" in e.value.message
    assert e.value.data["fimTokens"] == {"rep": 4}  # llama.cpp finds only <reponame>
    with pytest.raises(RpcError) as e:
        server.call("inference/generate", {"prompt": PREFIX, "suffix": SUFFIX})
    assert e.value.code == -32602
    assert server.call("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}})["text"]


@pytest.mark.parametrize("metadata", [False, True], ids=["spellings", "gguf-keys"])
def test_the_prompt_is_llama_servers_token_for_token(server, tmp_path, metadata):
    path = make_fim_model(tmp_path / "fim.gguf", metadata=metadata)
    server.call("model/load", {"model": path, "options": {"contextLength": 1024, "slots": 2, "batch": 256}})
    for extra in ([], [UTIL], [UTIL, ("b.py", "x = 1\n")]):
        params = {"prefix": PREFIX, "suffix": SUFFIX, "options": GREEDY}
        if extra:
            params["extra"] = [{"filename": n, "text": t} for n, t in extra]
        got = server.call("inference/infill", params)
        expected = format_infill(server, PREFIX, SUFFIX, extra, n_batch=256, n_ctx=1024, n_predict=12)
        assert got["usage"]["promptTokens"] == len(expected)
        assert got["dropped"] == {"prefix": 0, "suffix": 0, "extra": 0}
        ref = server.call("inference/generate", {"tokens": expected, "options": GREEDY})
        assert got["tokens"][: len(ref["tokens"])] == ref["tokens"], (got, ref)


def test_a_short_context_drops_the_far_ends_and_says_so(spawn, fim_path):
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": fim_path, "options": {"contextLength": 256, "slots": 1, "batch": 64}})
    lines = [f"x{i} = {i}\n" for i in range(300)]
    prefix = "".join(lines) + "def f():\n    return "
    suffix = "\n" + "".join(f"y{i} = {i}\n" for i in range(300))
    extra = [{"filename": UTIL[0], "text": UTIL[1]}]
    r = c.call("inference/infill", {"prefix": prefix, "suffix": suffix, "extra": extra, "options": GREEDY})
    budget = infill.Budget.of(64, 256, 12)
    assert (budget.prefix, budget.suffix, budget.extra) == (48, 14, 168)
    expected = format_infill(c, prefix, suffix, [UTIL], n_batch=64, n_ctx=256, n_predict=12)
    assert r["usage"]["promptTokens"] == len(expected)
    d = r["dropped"]
    pieces = c.call("inference/tokenize", {"text": prefix, "addSpecial": False, "parseSpecial": False})["pieces"]
    start = infill.window_start(len(pieces), 48)
    assert len(pieces) - 48 <= start < len(pieces) - 48 + 6
    assert d["prefix"] == len(prefix) - len("".join(pieces[start:])) > 0  # the prefix's start went
    pieces = c.call("inference/tokenize", {"text": suffix, "addSpecial": False, "parseSpecial": False})["pieces"]
    assert d["suffix"] == len(suffix) - len("".join(pieces[:14])) > 0  # the suffix's end went
    assert d["suffix"] > 0 and d["extra"] == 0  # the extra context fits in 168 tokens
    ref = c.call("inference/generate", {"tokens": expected, "options": GREEDY})
    assert r["tokens"][: len(ref["tokens"])] == ref["tokens"]


def test_spm_puts_the_suffix_first_and_a_keystroke_reads_only_the_end(fim):
    params = {"prefix": PREFIX, "suffix": SUFFIX, "extra": [{"filename": UTIL[0], "text": UTIL[1]}]}
    got = fim.call("inference/infill", {**params, "options": {**GREEDY, "spm": True}})
    expected = format_infill(fim, PREFIX, SUFFIX, [UTIL], n_batch=256, n_ctx=1024, n_predict=12, spm=True)
    assert got["usage"]["promptTokens"] == len(expected)
    ref = fim.call("inference/generate", {"tokens": expected, "options": GREEDY})
    assert got["tokens"][: len(ref["tokens"])] == ref["tokens"]
    # one keystroke later the pool has everything but the typed token and [FIM_MID]
    typed = fim.call("inference/infill", {**params, "prefix": PREFIX + "a", "options": {**GREEDY, "spm": True}})
    assert typed["usage"]["promptTokens"] - typed["usage"]["cachedTokens"] <= 3, typed["usage"]
    with pytest.raises(RpcError) as e:
        fim.call("inference/infill", {**params, "options": {"spm": 1}})
    assert e.value.code == -32602 and "spm" in e.value.message


@pytest.mark.parametrize("spm", [False, True])
def test_a_middle_follows_fim_mid_and_typing_on_its_line_reads_only_its_end(fim, spm):
    """The current line before the cursor as `middle`: after [FIM_MID], in either order, so a
    keystroke on the line leaves the prompt as it was up to the typed text."""
    prefix, middle = "def add(a, b):\n", "    return "
    params = {"prefix": prefix, "suffix": SUFFIX, "extra": [{"filename": UTIL[0], "text": UTIL[1]}]}
    opts = {**GREEDY, "spm": spm}
    got = fim.call("inference/infill", {**params, "middle": middle, "options": opts})
    expected = format_infill(fim, prefix, SUFFIX, [UTIL], n_batch=256, n_ctx=1024, n_predict=12, spm=spm, middle=middle)
    assert expected[-len(tokens(fim, middle)) - 1] == FIM_IDS["mid"]
    assert got["usage"]["promptTokens"] == len(expected)
    assert got["dropped"] == {"prefix": 0, "suffix": 0, "extra": 0, "middle": 0}
    ref = fim.call("inference/generate", {"tokens": expected, "options": GREEDY})
    assert got["tokens"][: len(ref["tokens"])] == ref["tokens"]
    reads = []
    for n in range(1, 8):
        typed = fim.call("inference/infill", {**params, "middle": middle + "a + b * c"[:n], "options": opts})
        reads.append(typed["usage"]["promptTokens"] - typed["usage"]["cachedTokens"])
    assert max(reads) <= 3, reads
    # an empty middle is a middle (the prefix's budget does not change as a line starts)
    empty = fim.call("inference/infill", {**params, "middle": "", "options": opts})
    assert empty["dropped"]["middle"] == 0
    with pytest.raises(RpcError) as e:
        fim.call("inference/infill", {**params, "middle": 1})
    assert e.value.code == -32602 and "middle" in e.value.message


def test_a_middle_over_its_budget_keeps_its_end(spawn, fim_path):
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": fim_path, "options": {"contextLength": 256, "slots": 1, "batch": 64}})
    budget = infill.Budget.of(64, 256, 12, middle=True)
    assert (budget.prefix, budget.middle, budget.suffix) == (40, 8, 14)
    middle = "x = " + "a + " * 30
    r = c.call("inference/infill", {"prefix": "", "middle": middle, "suffix": "\n", "options": GREEDY})
    pieces = c.call("inference/tokenize", {"text": middle, "addSpecial": False, "parseSpecial": False})["pieces"]
    start = infill.window_start(len(pieces), 8)
    assert r["dropped"]["middle"] == len(middle) - len("".join(pieces[start:])) > 0
    rest = format_infill(c, "", "\n", [], n_batch=64, n_ctx=256, n_predict=12, middle="")
    assert r["usage"]["promptTokens"] == len(rest) + len(pieces) - start


def test_typing_at_the_end_of_a_long_prefix_keeps_its_start(spawn, fim_path):
    """Over its budget the prefix's kept window moves in steps: a keystroke re-reads only what
    follows the edit (with the prefix pool), not the whole prompt."""
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": fim_path, "options": {"contextLength": 512, "slots": 1, "batch": 128}})
    prefix = "".join(f"x{i} = {i}\n" for i in range(200)) + "y = "
    opts = {**GREEDY, "maxTokens": 4, "spm": True}
    reads = []
    for n in range(12):
        r = c.call("inference/infill", {"prefix": prefix + "1" * n, "suffix": "\n", "options": opts})
        assert r["dropped"]["prefix"] > 0
        reads.append(r["usage"]["promptTokens"] - r["usage"]["cachedTokens"])
    assert sorted(reads)[len(reads) // 2] <= 3, reads  # the median keystroke reads a token or two


def test_generate_with_a_suffix_is_an_infill(fim):
    a = fim.call("inference/infill", {"prefix": PREFIX, "suffix": SUFFIX, "options": GREEDY})
    b = fim.call("inference/generate", {"prompt": PREFIX, "suffix": SUFFIX, "options": GREEDY})
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"] and b["dropped"] == a["dropped"]
    for bad in ({"tokens": [1, 2], "suffix": "x"}, {"prompt": "x", "suffix": "y", "addSpecial": True}):
        with pytest.raises(RpcError) as e:
            fim.call("inference/generate", bad)
        assert e.value.code == -32602 and "suffix" in e.value.message
    with pytest.raises(RpcError) as e:  # stopAtLine is infill's
        fim.call("inference/generate", {"prompt": PREFIX, "suffix": SUFFIX, "options": {"stopAtLine": True}})
    assert e.value.code == -32602


def test_stop_at_line_ends_at_the_first_line_break_after_text(fim):
    # "return " then the model writes a line, then more lines (SmolLM2 was not trained for FIM)
    free = fim.call("inference/infill", {"prefix": PREFIX, "suffix": SUFFIX, "options": {**GREEDY, "maxTokens": 24}})
    assert "\n" in free["text"].lstrip(), free  # without stopAtLine it goes on past the line
    line = fim.call(
        "inference/infill",
        {"prefix": PREFIX, "suffix": SUFFIX, "options": {**GREEDY, "maxTokens": 24, "stopAtLine": True}},
    )
    assert line["stopReason"] == "stop"
    assert "\n" not in line["text"].lstrip() and line["text"].strip()
    assert free["text"].startswith(line["text"] + "\n") or free["text"].startswith(line["text"] + "\r\n")


def test_infill_streams_and_the_stream_adds_up(fim):
    rid = fim.request_async(
        "inference/infill",
        {
            "prefix": PREFIX,
            "suffix": SUFFIX,
            "extra": [{"text": UTIL[1]}],
            "options": GREEDY,
            "partialResultToken": "p",
        },
    )
    result = fim.response(rid, timeout=60)["result"]
    pieces = fim.progress("p")
    assert "".join(p["text"] for p in pieces) == result["text"]
    assert [t for p in pieces for t in p["tokens"]] == result["tokens"]


def test_bad_params_are_32602(fim):
    for params, word in [
        ({"suffix": "x"}, "prefix"),
        ({"prefix": 1}, "prefix"),
        ({"prefix": "", "extra": {"text": "x"}}, "extra"),
        ({"prefix": "", "extra": [{"filename": "a"}]}, "text"),
        ({"prefix": "", "extra": [{"text": "x", "path": "a"}]}, "path"),
        ({"prefix": "", "extra": [{"text": "x"}] * 1025}, "1024"),
        ({"prefix": "", "options": {"stopAtLine": "yes"}}, "stopAtLine"),
        ({"prefix": "", "other": 1}, "other"),
    ]:
        with pytest.raises(RpcError) as e:
            fim.call("inference/infill", params)
        assert e.value.code == -32602 and word in e.value.message, (params, e.value.message)


def test_an_infill_is_the_same_alone_or_among_others(fim):
    """The promise, for completions: greedy and seeded infills give the same reply alone as among
    other infills and generations at once."""
    seeded = {"temperature": 0.8, "seed": 7, "maxTokens": 16}
    probes = [
        {"prefix": PREFIX, "suffix": SUFFIX, "options": GREEDY},
        {"prefix": "class Point:\n    def __init__(self, x, y):\n        ", "suffix": "\n", "options": seeded},
        {"prefix": PREFIX, "suffix": SUFFIX, "extra": [{"filename": UTIL[0], "text": UTIL[1]}], "options": seeded},
    ]
    alone = [fim.call("inference/infill", p, timeout=60)["tokens"] for p in probes]
    others = [
        ("inference/generate", {"prompt": "Once upon a time", "options": {"maxTokens": 40, "seed": 3}}),
        ("inference/infill", {"prefix": "import os\n" * 20, "suffix": "", "options": {"maxTokens": 30}}),
        ("inference/chat", {"messages": [{"role": "user", "content": "Hi"}], "options": {"maxTokens": 30}}),
    ]
    for order in (0, 1):
        ids = [fim.request_async(m, p) for m, p in others]
        mine = [fim.request_async("inference/infill", p) for p in (probes if order == 0 else probes[::-1])]
        got = [fim.response(r, timeout=120)["result"]["tokens"] for r in mine]
        if order == 1:
            got = got[::-1]
        assert got == alone
        for r in ids:
            assert "result" in fim.response(r, timeout=120)


def test_fim_tokens_from_the_vocabulary_when_the_backend_does_not_say(fim_path):
    """kinfer's own search of the vocabulary (for backends without FillInMiddle) finds what
    llama.cpp finds."""
    from kinfer_rpc.default_plugins.llama import LlamaBackend
    from kinfer_rpc.types import LoadOptions

    model = LlamaBackend().load(fim_path, LoadOptions(context_length=64, slots=1, gpu_layers=0), lambda _: None)
    try:

        class Plain:  # the model without its fim_tokens
            info = model.info
            tokenize = staticmethod(model.tokenize)
            token_bytes = staticmethod(model.token_bytes)

        assert infill.fim_tokens(model) == {**FIM_IDS, "rep": 4}
        searched = infill.fim_tokens(Plain())  # type: ignore[arg-type]
        assert searched == {**FIM_IDS, "rep": 4}
    finally:
        model.close()


def test_a_repeated_suffix_is_trimmed():
    assert infill.trim_repeated_suffix("a + b\n\nprint(add(1, 2))\n", SUFFIX) == "a + b"
    assert infill.trim_repeated_suffix("a + b", SUFFIX) == "a + b"
    assert infill.trim_repeated_suffix("x)", ")") == "x"
    assert infill.trim_repeated_suffix("x", "") == "x"


@pytest.mark.parametrize(
    "pieces, text",
    [
        (["  \n", "  foo", "(a)\n", "never"], "  \n  foo(a)"),
        (["x\r", "\ny"], "x"),
        (["\n\n", "a"], "\n\na"),
        (["ab\r"], "ab\r"),
        (["é", "\n"], "é"),
    ],
)
def test_stop_at_line_in_the_text_stream(pieces, text):
    s = TextStream(stop_at_line=True)
    out = ""
    for p in pieces:
        if s.stopped:
            break
        out += s.push(p.encode())
    out += s.finish()
    assert out == text and s.text == text
    assert json.dumps(out)
