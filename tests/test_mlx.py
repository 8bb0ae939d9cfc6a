"""The mlx backend on the CPU (mlx[cpu]): the embedded GGUF against llama.cpp, MLX folders, Ollama
safetensors models, the engine's invariants, and the protocol.

MLX's CPU quantized matmul runs single-threaded at about 1 GMAC/s (7 tok/s on SmolLM2-135M), so
every case here generates a handful of tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("mlx.core")

from engine_helpers import WORDS, mlx_kernel_engine, run_until_done  # noqa: E402
from protocol_fixtures import server, spawn  # noqa: E402,F401
from rpcclient import error_of  # noqa: E402

from kinfer_rpc import errors  # noqa: E402
from kinfer_rpc.default_plugins import drafts as kinfer_drafts  # noqa: E402
from kinfer_rpc.default_plugins import mlx as kinfer_mlx  # noqa: E402
from kinfer_rpc.default_plugins.llama import LlamaBackend  # noqa: E402
from kinfer_rpc.default_plugins.mlx import MlxBackend  # noqa: E402
from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.sampling import SamplingOptions  # noqa: E402
from kinfer_rpc.engine.scheduler import Engine  # noqa: E402
from kinfer_rpc.host.store import ModelStore, embedded_default_path  # noqa: E402
from kinfer_rpc.types import DraftRequest, LoadOptions, SeqChunk  # noqa: E402

pytestmark = pytest.mark.model  # every test here loads a real model

GGUF = embedded_default_path()
CTX = 256


@functools.cache
def mlx_model(slots=4, path=GGUF):
    return MlxBackend().load(path, LoadOptions(context_length=CTX, slots=slots), lambda f: None)


@functools.lru_cache(maxsize=1)
def llama_model():
    return LlamaBackend().load(GGUF, LoadOptions(context_length=CTX, slots=1, threads=2, kv_type="f16"), lambda f: None)


@functools.lru_cache(maxsize=1)
def ngram():
    found = []
    kinfer_drafts.register_draft_policies(found.append)
    return found[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An MLX folder written from the embedded GGUF's weights by mlx-lm's save functions."""
    import make_mlx_model

    out = tmp_path_factory.mktemp("models") / "smollm2-mlx"
    make_mlx_model.from_gguf(out, GGUF, bits=4, group=64)
    return out


def engine(slots=4, batch=64, drafts=0, path=GGUF) -> Engine:
    opts = LoadOptions(context_length=CTX, slots=slots, batch=batch, drafts=drafts)
    e = Engine(lambda p: MlxBackend().load(path, opts, p), lambda fn: fn(), batch=batch, prefix=-1)
    e.load_model()
    return e


def job(prompt, n=4, temperature=0.0, seed=1, drafts=0):
    return Job(
        list(prompt),
        GenerateOptions(
            max_tokens=n,
            drafts=drafts,
            draft_policy=ngram() if drafts else None,
            sampling=SamplingOptions(temperature=temperature, seed=seed),
        ),
    )


@functools.cache
def alone(prompt: tuple, n: int, temperature: float, seed: int) -> tuple:
    e = _alone_engine()
    (j,) = run_until_done(e, [job(prompt, n, temperature, seed)])
    return tuple(j.generated)


@functools.lru_cache(maxsize=1)
def _alone_engine():
    return engine(slots=1)


PROMPT = "<|im_start|>user\nWhat is the capital of France? Tell me about Paris.<|im_end|>\n<|im_start|>assistant\n"


def test_logits_match_llama_cpp():
    """The GGUF on MLX (traditional rope on llama.cpp's Q/K layout) against llama.cpp, every
    prompt position. llama.cpp's CPU matmul rounds activations to 8 bits, so logits differ by
    rounding: correlation above 0.995 at every position, mean difference under 0.5 (logits span about 40), and the
    same top token wherever llama.cpp's best two are more than 0.05 apart."""
    m, ref = mlx_model(), llama_model()
    tokens = ref.tokenize(PROMPT, True, True)
    ref.seq_remove(0)
    b = ref.decode([SeqChunk(0, 0, tokens, len(tokens))])().copy()
    m.seq_remove(0)
    a = m.decode([SeqChunk(0, 0, tokens, len(tokens))])()
    m.seq_remove(0)
    assert a.shape == b.shape == (len(tokens), 49152)
    top2 = np.sort(b, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05
    assert clear.sum() >= len(tokens) - 4  # near-ties are left out; most positions are compared
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.9
    assert (a.argmax(1) == b.argmax(1))[clear].all()
    assert np.abs(a - b).mean() < 0.5
    assert min(np.corrcoef(a[i], b[i])[0, 1] for i in range(len(tokens))) > 0.995  # the NeoX layout: 0.72


TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\t x",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "12345678901234",
    "3.14159 and 2,718",
    "can't won't I'm you'll they'd",
    "müde café naïve über",
    "東京タワー 日本語",
    "🙂👍🏽 emoji",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>",
    "a<|im_end|>b<|endoftext|>",
    "<reponame>kinfer<file_sep>x",
    "<|im_start",
    "   multiple   spaces   ",
    "\u00a0nbsp\u2003em",
    "ÀÉÎÕÜ ß ẞ",
]


def test_tokenizer_matches_llama_cpp():
    m, ref = mlx_model(), llama_model()
    for text in TEXTS:
        for add_special in (False, True):
            for parse_special in (False, True):
                assert m.tokenize(text, add_special, parse_special) == ref.tokenize(text, add_special, parse_special), (
                    text,
                    add_special,
                    parse_special,
                )
    assert all(m.token_bytes(t) == ref.token_bytes(t) for t in range(m.info.n_vocab))
    assert set(m.eog_tokens()) == set(ref.eog_tokens())
    assert m.chat_template() == ref.chat_template()
    assert (m.info.bos_text, m.info.eos_text, m.info.add_bos) == (
        ref.info.bos_text,
        ref.info.eos_text,
        ref.info.add_bos,
    )


def test_seq_copy_and_remove_give_the_cells_a_recomputation_would():
    m = mlx_model()
    p = m.tokenize("The quick brown fox jumps over the lazy dog", True, True)
    for s in range(4):
        m.seq_remove(s)
    m.decode([SeqChunk(0, 0, p, 1)])()
    m.seq_copy(0, 1)
    m.seq_remove(1, 5, -1)  # slot 1 keeps the first 5 cells
    fresh = m.decode([SeqChunk(2, 0, p[:6], 1)])().copy()
    after_copy = m.decode([SeqChunk(1, 5, p[5:6], 1)])().copy()
    assert np.array_equal(fresh, after_copy)
    m.seq_remove(0, 3, -1)
    again = m.decode([SeqChunk(0, 3, p[3:6], 1)])().copy()
    assert np.array_equal(again, fresh)
    with pytest.raises(NotImplementedError):
        m.seq_remove(2, 1, 3)  # a hole in the middle
    for s in range(4):
        m.seq_remove(s)
    assert m.memory()["device"] == "cpu" and m.memory()["kvBytes"] > 0


def _prompts(e, texts):
    return [e.model.tokenize(t, True, True) for t in texts]


def test_batched_replies_equal_alone_and_drafts_change_nothing():
    e = engine(slots=4, batch=16)
    prompts = _prompts(
        e,
        [
            "The capital of France is",
            "1 2 3 4 5 6 7 8 9 10 11 12",
            "Once upon a time, in a land far away, there lived a",
        ],
    )
    solo = [list(alone(tuple(p), 5, 0.0, 1)) for p in prompts]
    together = run_until_done(e, [job(p, 5) for p in prompts], arrivals=[0, 1, 3])
    assert [j.generated for j in together] == solo
    d = engine(slots=4, batch=16, drafts=4)
    assert d.model.info.drafts == 4
    drafted = run_until_done(d, [job(p, 5, drafts=4) for p in prompts], arrivals=[0, 0, 2])
    assert [j.generated for j in drafted] == solo
    assert sum(j.drafted for j in drafted) > 0 and sum(j.accepted for j in drafted) > 0  # the counting prompt


def test_default_drafts_on_the_cpu_is_the_table_value():
    m = MlxBackend().load(GGUF, LoadOptions(context_length=64, slots=1, drafts=None), lambda f: None)
    assert m.info.drafts == kinfer_mlx.DEFAULT_DRAFTS["cpu", m.weights]
    assert kinfer_mlx.pick_drafts([1.0, 2.0, 3.0]) == 0 and kinfer_mlx.pick_drafts([1.0, 1.0, 1.0, 4.0]) == 2


def test_weights_quantized_and_dense_agree():
    """`weights`: quantized (as the GGUF stores them) and dense (expanded to float32 at load) both
    load and generate, agree on the prompt's next token and closely on its logits; the default
    on the CPU is dense when it fits (half the available host memory)."""
    p = mlx_model().tokenize(PROMPT, True, True)
    rows = {}
    quantized_size = 0
    for form in ("quantized", "dense"):
        m = MlxBackend().load(GGUF, LoadOptions(context_length=64 + len(p), slots=1, weights=form), lambda f: None)
        assert m.info.weights == form
        rows[form] = m.decode([SeqChunk(0, 0, p, 1)])()[0].copy()
        nxt = int(rows[form].argmax())
        assert m.decode([SeqChunk(0, len(p), [nxt], 1)])().shape == (1, 49152)
        if form == "dense":
            assert m.info.size_bytes > 3 * quantized_size
        quantized_size = m.info.size_bytes
    q, d = rows["quantized"], rows["dense"]
    assert q.argmax() == d.argmax()
    assert np.abs(q - d).max() < 0.05 and np.corrcoef(q, d)[0, 1] > 0.9999
    assert mlx_model().info.weights == "dense"  # the CPU default for a 135M model
    with pytest.raises(ValueError, match="weights"):
        MlxBackend().load(GGUF, LoadOptions(context_length=64, slots=1, weights="fp8"), lambda f: None)


def test_device_greedy_rows_give_the_host_argmax():
    """Slots set for device greedy get the argmax of the logits the host would have seen (every
    output row, drafts too); a host-sampled slot's rows come back as -1 with their logits in
    place."""
    m = MlxBackend().load(GGUF, LoadOptions(context_length=64, slots=2, drafts=3), lambda f: None)
    p = m.tokenize("The quick brown fox jumps over the lazy dog and then", True, True)
    chunks = [SeqChunk(0, 0, p, 1), SeqChunk(1, 0, p[:-2], 1)]
    host = m.decode(chunks)().copy()
    assert m.sampled_tokens() == [-1, -1]
    n = len(p)
    steps = [SeqChunk(0, n, [5, 6, 7, 8], 4), SeqChunk(1, n - 2, [9], 1)]
    host_steps = m.decode(steps)().copy()
    for s in (0, 1):
        m.seq_remove(s)
    assert m.set_device_greedy(0, True)
    mixed = m.decode(chunks)()
    assert m.sampled_tokens() == [int(host[0].argmax()), -1]
    assert np.array_equal(mixed[1], host[1])
    assert m.set_device_greedy(1, True)
    m.decode(steps)()
    assert m.sampled_tokens() == host_steps.argmax(axis=1).tolist()
    assert m.set_device_greedy(0, False) and m.set_device_greedy(1, False)


def test_queued_greedy_passes_give_the_host_argmax_replies():
    """Greedy requests on the device with the next pass chained to each (fed with its own argmax)
    give the replies the host's argmax gives, whether requests join, end or run alone; the
    chained pass is used while the sequences go on and dropped when they change."""

    def host_loader(p):
        m = MlxBackend().load(GGUF, LoadOptions(context_length=CTX, slots=3, batch=16, drafts=0), p)
        m.device_greedy = False  # the engine then takes every argmax on the host
        return m

    host = Engine(host_loader, lambda fn: fn(), batch=16, prefix=-1, start_ahead=False)
    host.load_model()
    e = engine(slots=3, batch=16)
    prompts = _prompts(e, ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time"])
    chained = []
    decode_chained = e.model.decode_chained
    e.model.decode_chained = lambda: chained.append(1) or decode_chained()
    for arrivals, n in (([0, 0, 0], 6), ([0, 2, 5], 7), ([0, 9, 9], 3)):
        want = run_until_done(host, [job(p, n) for p in prompts], arrivals=arrivals)
        got = run_until_done(e, [job(p, n + i) for i, p in enumerate(prompts)], arrivals=arrivals)
        assert [j.generated[:n] for j in got] == [j.generated for j in want]
    assert chained  # passes were chained on the device ...
    assert e.started_ahead and not host.started_ahead  # ... and the engine used them


def test_draft_pair_agrees_with_its_target(tmp_path):
    """make_mlx_model.py --draft-pair (the benchmarks' accepted drafts): the target's layers after
    the draft's write nothing, so the draft's logits are the target's, bit for bit; the target
    keeps all its layers (it costs what a plain model of its shape costs)."""
    import argparse

    import make_mlx_model
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_lm_load

    a = argparse.Namespace(
        hidden=64, layers=4, heads=2, kv_heads=1, intermediate=128, vocab=49152, bits=4, group=64,
        seed=3, tokenizer_gguf=None, draft_pair=str(tmp_path / "draft"), draft_layers=1,
    )  # fmt: skip
    make_mlx_model.random_llama(tmp_path / "target", a)
    target, _ = mlx_lm_load(str(tmp_path / "target"))
    draft, _ = mlx_lm_load(str(tmp_path / "draft"))
    assert (len(target.layers), len(draft.layers)) == (4, 1)
    x = mx.array([[1, 500, 900, 33, 7000, 12]])
    want, got = target(x), draft(x)
    assert mx.array_equal(want, got).item()
    plain = argparse.Namespace(**{**vars(a), "draft_pair": None})
    make_mlx_model.random_llama(tmp_path / "plain", plain)  # the same weights, every layer writing
    assert not mx.array_equal(mlx_lm_load(str(tmp_path / "plain"))[0](x), want).item()


def test_a_draft_model_on_mlx_chains_its_rounds_in_one_wait():
    """The draft-model policy on the mlx backend: each step's draft rounds are chained on the
    device to the catch-up pass (one decode() a step, then decode_chained; the host reads the
    drafts once), and they are the drafts that round-by-round passes read on the host give.
    SmolLM2 drafting for itself: its drafts are its own greedy reply, and through the engine
    every draft is accepted and the replies are the ones without drafting."""
    opts = LoadOptions(context_length=CTX, slots=2, batch=64, drafts=3, draft_model=GGUF)
    target = mlx_model(slots=2)
    chained = kinfer_drafts.DraftModelPolicy().session(target, MlxBackend(), opts)
    host = kinfer_drafts.DraftModelPolicy().session(target, MlxBackend(), opts)
    assert chained.chained and host.chained
    host.chained = False
    for seq in range(2):
        host.draft.set_device_greedy(seq, False)
    calls = []
    for name in ("decode", "decode_chained"):
        fn = getattr(chained.draft, name)
        setattr(chained.draft, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    e = _alone_engine()
    a, b = _prompts(e, ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12"])
    want_a, want_b = alone(tuple(a), 8, 0.0, 1), alone(tuple(b), 8, 0.0, 1)
    DR = DraftRequest
    steps = [
        [DR(0, a, 4), DR(1, b, 2)],  # both prompts caught up in one pass, then 3 chained rounds
        [DR(0, a + list(want_a[:3]), 4), DR(1, b + [want_b[0], 7], 3)],  # accepted drafts; a rejected one
        [DR(1, b + list(want_b[:2]), 1)],  # one round: nothing chained
    ]
    for step in steps:
        calls.clear()
        got = chained.propose_many(step)
        assert got == host.propose_many(step)
        assert [len(d) for d in got] == [r.k for r in step]
        k_max = max(r.k for r in step)
        assert calls == ["decode"] + ["decode_chained"] * (k_max - 1)
    assert chained.propose_many(steps[0]) == [list(want_a[:4]), list(want_b[:2])]
    for s in (chained, host):
        s.close()


def test_draft_model_drafts_reach_the_verify_pass_on_the_device():
    """Through the engine, the draft model's rounds feed the target's verify pass on the device
    (SeqChunk.device_tokens) and the host reads them after that pass's wait: each drafting step
    is the draft passes launched, the verify pass launched, ONE wait (the verify pass's), then
    the drafts read (their waits find them done). Greedy and seeded-sampled replies (whose
    drafts get rejected) are the ones without drafting; the drafts read are the ones fed."""
    opts = LoadOptions(context_length=CTX, slots=3, batch=64, drafts=3, draft_model=GGUF)
    d = Engine(
        lambda p: MlxBackend().load(GGUF, opts, p),
        lambda fn: fn(),
        batch=64,
        prefix=-1,
        draft_session=lambda policy, model: policy.session(model, MlxBackend(), opts),
    )
    d.load_model()
    policy = kinfer_drafts.DraftModelPolicy()
    session = d.drafter.session(policy)
    events: list[str] = []
    fed: list[list[int]] = []  # the verify passes' device-fed tokens, read back by the test

    def spy(obj, name, tag):
        fn = getattr(obj, name)

        def launch(*a):
            if tag == "verify":
                for c in a[0]:
                    if c.device_tokens is not None:
                        handles, row = c.device_tokens
                        events.append("fed")
                        fed.append([int(np.asarray(h)[row]) for h in handles[: len(c.tokens) - 1]])
            events.append(tag)
            wait = fn(*a)

            def waited():
                events.append(f"{tag}-wait")
                return wait()

            return waited

        setattr(obj, name, launch)

    spy(d.model, "decode", "verify")
    spy(session.draft, "decode", "draft")
    spy(session.draft, "decode_chained", "chain")
    e = _alone_engine()
    a, b, c = _prompts(e, ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time"])
    want = [alone(tuple(a), 12, 0.0, 1), alone(tuple(b), 12, 0.0, 1), alone(tuple(c), 12, 0.8, 5)]
    samplings = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.0), SamplingOptions(0.8, seed=5)]
    jobs = [
        Job(list(p), GenerateOptions(max_tokens=12, drafts=3, draft_policy=policy, sampling=s))
        for p, s in zip((a, b, c), samplings)
    ]
    read: list[list[int]] = []
    settle = d._settle_drafts
    d._settle_drafts = lambda job, base, taken: read.append(list(job.drafts)) or settle(job, base, taken)
    run_until_done(d, jobs, arrivals=[0, 1, 1])
    assert [tuple(j.generated) for j in jobs] == want
    assert jobs[0].accepted == jobs[0].drafted > 0  # SmolLM2 drafting greedily for itself
    assert jobs[2].accepted < jobs[2].drafted  # sampled: some drafts rejected, the reply unchanged
    assert "fed" in events
    # Split at each verify launch: a drafting step's draft passes all come before it, and
    # nothing of the draft model waits until the verify pass has.
    log = " ".join(events)
    for step in log.split(" verify ")[1:]:
        head, _, tail = step.partition("verify-wait")
        assert "wait" not in head, log
    drafting = log.split("draft ")[1:]
    assert drafting and all(s.index("verify-wait") < s.index("draft-wait") for s in drafting), log
    assert sorted(map(tuple, fed)) == sorted(map(tuple, read))  # the drafts verified are the ones fed
    session.close()


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    words=st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12), min_size=2, max_size=3),
    arrivals=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    temperature=st.sampled_from([0.0, 0.8]),
    batch=st.sampled_from([4, 16]),
)
def test_property_reply_independent_of_neighbours(words, arrivals, temperature, batch):
    """Any prompts, arrival steps and pass sizes: each reply is the one it gets alone (CPU: MLX's
    quantized matmul gives a row the same result whatever the rows beside it)."""
    e = _property_engine(batch)
    prompts = _prompts(e, [" ".join(w) for w in words])
    jobs = run_until_done(
        e, [job(p, 3, temperature, seed=7 + i) for i, p in enumerate(prompts)], arrivals=arrivals[: len(prompts)]
    )
    for p, j, i in zip(prompts, jobs, range(len(prompts))):
        assert tuple(j.generated) == alone(tuple(p), 3, temperature, 7 + i)


@functools.cache
def _property_engine(batch):
    return engine(slots=3, batch=batch)


def test_folder_and_ollama_safetensors_load(folder, tmp_path, monkeypatch):
    """The folder mlx-lm wrote, and the same weights as an Ollama safetensors model (one blob per
    tensor, json layers for the config and tokenizer), give the same tokens."""
    m = mlx_model(2, str(folder))
    assert m.info.backend == "mlx" and m.info.architecture == "llama" and m.chat_template()
    p = m.tokenize(PROMPT, True, True)
    assert p == mlx_model().tokenize(PROMPT, True, True)
    ref = m.decode([SeqChunk(0, 0, p, 1)])().copy()
    m.seq_remove(0)
    # An Ollama store holding the folder's tensors.
    import mlx.core as mx

    store = tmp_path / "ollama"
    (store / "blobs").mkdir(parents=True)
    layers = []

    def blob(data: bytes, media: str, name: str):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (store / "blobs" / digest.replace(":", "-")).write_bytes(data)
        layers.append({"mediaType": media, "digest": digest, "size": len(data), "name": name})

    weights = mx.load(str(folder / "model.safetensors"))
    for name in sorted(k for k in weights if not k.endswith((".scales", ".biases"))):
        group = {k: weights[k] for k in weights if k == name or k.rsplit(".", 1)[0] == name.rsplit(".", 1)[0]}
        path = tmp_path / "one.safetensors"
        mx.save_safetensors(str(path), group)
        blob(path.read_bytes(), "application/vnd.ollama.image.tensor", name)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        blob((folder / f).read_bytes(), "application/vnd.ollama.image.json", f)
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "smolmlx" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    ref_o = ModelStore().resolve("smolmlx")
    assert ref_o.format == "mlx"
    o = MlxBackend().load(ref_o.path, LoadOptions(context_length=CTX, slots=1), lambda f: None)
    assert o.tokenize(PROMPT, True, True) == p
    assert np.array_equal(o.decode([SeqChunk(0, 0, p, 1)])(), ref)


def test_over_the_protocol(spawn, folder):  # noqa: F811
    """The real server: mlx listed; an MLX folder loads on mlx by itself; a GGUF goes to llama
    unless `backend: "mlx"` is asked for; chats on both MLX loads answer the tokens the engine
    gives in-process. Without the mlx plugin a folder is -31005, "needs the mlx backend"."""
    c = spawn()
    caps = c.initialize()["capabilities"]
    assert "mlx" in json.dumps(caps)
    messages = [{"role": "user", "content": "Name a colour."}]
    loaded = c.call("model/load", {"model": str(folder), "options": {"slots": 2, "contextLength": CTX}}, timeout=120)
    assert loaded["backend"] == "mlx" and loaded["drafts"] == kinfer_mlx.DEFAULT_DRAFTS["cpu", loaded["weights"]]
    reply = c.call(
        "inference/chat",
        {"model": str(folder), "messages": messages, "options": {"maxTokens": 4, "temperature": 0}},
        timeout=120,
    )
    assert reply["usage"]["completionTokens"] == len(reply["tokens"]) > 0
    e = engine(slots=1, path=str(folder))
    from kinfer_rpc.host import templates as chat

    prompt = e.model.tokenize(
        chat.render(e.template, messages, bos=e.model.info.bos_text, eos=e.model.info.eos_text), False, True
    )
    (j,) = run_until_done(e, [job(prompt, 4)])
    assert reply["tokens"] == j.generated and reply["text"] == j.text
    assert loaded["weights"] == "dense"  # the CPU default for a small model
    bad = error_of(c.request("model/load", {"model": GGUF, "options": {"weights": "fp8"}}))
    assert bad["code"] == errors.INVALID_PARAMS and "weights" in bad["message"]
    on_llama = error_of(c.request("model/load", {"model": GGUF, "options": {"weights": "dense"}}))
    assert on_llama["code"] == errors.NOT_SUPPORTED and "llama" in on_llama["message"]
    llama = c.call("model/load", {"model": GGUF, "options": {"contextLength": CTX, "weights": "quantized"}})
    assert llama["backend"] == "llama" and llama["weights"] == "quantized"
    c.call("model/unload", {"model": GGUF})
    on_mlx = c.call(
        "model/load", {"model": GGUF, "backend": "mlx", "options": {"slots": 1, "contextLength": CTX}}, timeout=120
    )
    assert on_mlx["backend"] == "mlx"
    g = c.call(
        "inference/generate",
        {"model": GGUF, "prompt": "The capital of France is", "options": {"maxTokens": 3, "temperature": 0}},
        timeout=120,
    )
    assert g["tokens"] == list(alone(tuple(mlx_model().tokenize("The capital of France is", False, True)), 3, 0.0, 1))
    # A draft model runs on the model's backend: an MLX folder drafts for a model on mlx, not on llama.
    c.call("model/unload", {"model": GGUF})
    drafting = {"contextLength": CTX, "draftPolicy": "draft-model", "draftModel": str(folder)}
    refused = error_of(c.request("model/load", {"model": GGUF, "options": drafting}))
    assert refused["code"] == errors.NOT_SUPPORTED and "llama backend" in refused["message"], refused
    drafted = c.call("model/load", {"model": GGUF, "backend": "mlx", "options": {"slots": 1, **drafting}}, timeout=120)
    assert drafted["backend"] == "mlx" and drafted["draftPolicy"] == "draft-model"
    g2 = c.call(
        "inference/generate",
        {"model": GGUF, "prompt": "The capital of France is", "options": {"maxTokens": 3, "temperature": 0}},
        timeout=120,
    )
    assert g2["tokens"] == g["tokens"] and g2["usage"]["draftTokens"] > 0
    c.call("model/unload", {"model": GGUF})
    mtp = error_of(c.request("model/load", {"model": GGUF, "backend": "mlx", "options": {"draftPolicy": "mtp"}}))
    assert mtp["code"] == errors.LOAD_FAILED and "multi-token-prediction layers; use the llama" in mtp["message"], mtp
    bare = spawn(env={**os.environ, "KINFER_RPC_PLUGINS": "llama,drafts"})
    bare.initialize()
    err = error_of(bare.request("model/load", {"model": str(folder)}))
    assert err["code"] == errors.BACKEND_UNAVAILABLE and "needs the mlx backend" in err["message"]


def test_attention_kernel_load_check_tells_a_right_kernel_from_a_wrong_one(monkeypatch):
    """The CUDA decode attention kernel (default_plugins/mlx/attention.py) cannot run here; what can:
    the check the backend runs at every GPU load before using it. It passes MLX's own attention and
    writes, and fails one that drops a row's last cell, mixes up the slots, or attends right but
    leaves the buffers unwritten."""
    import mlx.core as mx

    from kinfer_rpc.default_plugins.mlx import attention as att

    assert not att.available()  # no CUDA here: loads keep MLX's attention (kernel off)
    m = MlxBackend().load(GGUF, LoadOptions(context_length=64, slots=1), lambda f: None)
    assert m.kernel == 0
    reference = att.reference

    def fake(shift=0, order=slice(None), write=True, scale_if_group=1.0):
        def attention(q, nk, nv, k, v, s, c, sc, counter, heads=None, splits=None):
            if not write:  # right attention, buffers untouched
                k2, v2 = mx.array(k), mx.array(v)
                return reference(q, nk, nv, k2, v2, s, c, sc)
            out = reference(q, nk, nv, k, v, s[order], mx.maximum(c - shift, 0), sc)
            return out * (1.0 if heads == 1 else scale_if_group)

        return attention

    monkeypatch.setattr(att, "attention", fake())
    assert att.self_check(mx.float32, 64, 4) < 1e-4
    monkeypatch.setattr(att, "attention", fake(shift=1))
    assert att.self_check(mx.float32, 64, 4) > 0.02
    monkeypatch.setattr(att, "attention", fake(order=slice(None, None, -1)))
    assert att.self_check(mx.float32, 128, 1) > 0.02
    monkeypatch.setattr(att, "attention", fake(write=False))
    assert att.self_check(mx.float32, 64, 4) == float("inf")
    # the two block shapes (a kv head's group of query heads, or one query head) must agree bit for bit
    monkeypatch.setattr(att, "attention", fake(scale_if_group=1.0001))
    assert att.self_check(mx.float32, 64, 4) == float("inf")


def test_attention_kernel_contract_in_the_compiled_pass(monkeypatch):
    """The decode passes as they run with the CUDA kernel, here on the CPU: the kernel's part (it
    writes the pass's cells into the buffers it is given and returns the attention) played by
    MLX's own operations (kinfer_mlx_attention.reference), routed as on the GPU, the layers'
    cache writes left to it and the buffers handed on through mx.depends. Replies (rows joining
    and leaving, prompts beside decode rows in one step, queued greedy passes, drafts) are the
    kernel-off replies."""
    calls: list[int] = []
    e = mlx_kernel_engine(monkeypatch, GGUF, calls, context_length=CTX, slots=3)
    assert e.model.kernel == 1 and e.model.counter.size == 3 * 9  # SmolLM2: 9 query heads
    prompts = _prompts(e, ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time"])
    solo = [list(alone(tuple(p), 5, 0.0, 1)) for p in prompts]
    got = run_until_done(e, [job(p, 5) for p in prompts], arrivals=[0, 2, 3])
    assert [j.generated for j in got] == solo
    assert calls  # the compiled passes went through the kernel's route
    d = mlx_kernel_engine(monkeypatch, GGUF, calls, drafts=3, context_length=CTX, slots=3)
    drafted = run_until_done(d, [job(p, 5, drafts=3) for p in prompts], arrivals=[0, 0, 1])
    assert [j.generated for j in drafted] == solo
    assert sum(j.accepted for j in drafted) > 0


def test_mlx_keeps_its_compiled_cuda_kernels_under_kinfer_home(tmp_path):
    """MLX_PTX_CACHE_DIR (where MLX keeps the CUDA kernels it compiles on first use; by default
    under the temporary directory) is $KINFER_HOME/cache/mlx-ptx once the backend is imported,
    unless the user named a place."""
    import subprocess
    import sys

    code = "import os, kinfer_rpc.default_plugins.mlx; print(os.environ['MLX_PTX_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"} | {"KINFER_HOME": str(tmp_path)}
    for mine, want in ((None, tmp_path / "cache" / "mlx-ptx"), (str(tmp_path / "mine"), tmp_path / "mine")):
        run_env = env | ({"MLX_PTX_CACHE_DIR": mine} if mine else {})
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(want)


def test_a_constrained_reply_with_logprobs_on_mlx():
    """The grammar masks and logprobs work from what every backend offers (token bytes, logits
    rows): on the mlx backend a schema-held greedy reply is valid JSON and the same, with its
    logprobs, alone and among others."""
    import attrs

    from kinfer_rpc.engine.grammar import Grammars

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    prompt = mlx_model().tokenize(
        PROMPT.replace("France? Tell me about Paris.", "France? Answer in JSON."), False, True
    )

    def held(model_engine, n=40):
        j = job(prompt, n)
        j = Job(
            j.prompt,
            attrs.evolve(j.options, logprobs=2),
            constraint=Grammars().matcher(model_engine.model, "format", schema),
        )
        return j

    e = engine(slots=4)
    lone = held(e)
    run_until_done(e, [lone])
    assert lone.stop_reason == "stop" and json.loads(lone.text)["city"]
    together = [held(e), job(prompt, 12, 0.8, 3), job(prompt[:9], 20)]
    run_until_done(e, together, arrivals=[1, 0, 0])
    assert together[0].generated == lone.generated and together[0].logprobs == lone.logprobs


def _rows_one_by_one(monkeypatch, calls=None, nudge=None):
    """matmul.py's kernels played on the CPU by MLX's own products a row at a time (rows that
    cannot depend on each other); `calls` collects each call's row count; `nudge(M)` adds a
    pass-dependent error (what the load check must catch)."""
    import mlx.core as mx

    from kinfer_rpc.default_plugins.mlx import matmul as mm

    def by_rows(x, product):
        x2 = x.reshape(-1, x.shape[-1])
        M = x2.shape[0]
        if calls is not None:
            calls.append(M)
        y = mx.concatenate([product(x2[i : i + 1]) for i in range(M)])
        if nudge is not None:
            y = y * (1.0 + nudge(M))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def quantized(x, w, scales, biases, group_size, bits, form="mma"):
        return by_rows(
            x, lambda r: mx.quantized_matmul(r, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
        )

    monkeypatch.setattr(mm, "quantized", quantized)
    monkeypatch.setattr(mm, "dense", lambda x, w, form="mma": by_rows(x, lambda r: r @ w.T))


def test_row_invariant_matmul_load_check_tells_a_right_kernel_from_a_wrong_one(monkeypatch):
    """The CUDA row-invariant matmul (default_plugins/mlx/matmul.py) cannot run here; what can: the
    check a GPU load runs before routing the decode passes to it. It passes products that match
    MLX's and give every row the same bits in every pass, and fails one that is off by a scale,
    and one whose rows depend on how many share the pass."""
    import mlx.core as mx

    from kinfer_rpc.default_plugins.mlx import matmul as mm

    assert not mm.available()  # no CUDA here: loads keep MLX's products
    assert not mlx_model().rows_matmul
    _rows_one_by_one(monkeypatch)
    for group, bits in ((64, 4), (32, 8), (128, 4)):
        worst, same = mm.self_check(mx.float32, group, bits)
        assert same and worst < 1e-5
    _rows_one_by_one(monkeypatch, nudge=lambda M: 0.01)
    worst, same = mm.self_check(mx.float32, 64, 4)
    assert same and worst > 0.005  # off by 1%: refused
    _rows_one_by_one(monkeypatch, nudge=lambda M: 1e-6 * (M > 8))
    worst, same = mm.self_check(mx.float32, 64, 4)
    assert not same and worst < 0.005  # close enough, but a row's bits depend on the pass: refused
    # weights that do not match x's rows are refused before any kernel runs
    monkeypatch.undo()
    wq, scales, biases = mx.quantize(mx.zeros((32, 128)), group_size=64, bits=4)
    with pytest.raises(ValueError, match="do not match"):
        mm.quantized(mx.zeros((1, 64), dtype=mx.float16), wq, scales, biases, 64, 4)
    with pytest.raises(ValueError, match="x's rows and type"):
        mm.dense(mx.zeros((1, 64), dtype=mx.float16), mx.zeros((32, 128), dtype=mx.float16))


def test_row_invariant_matmul_routes_the_decode_passes(monkeypatch, folder):
    """How a GPU load uses the row-invariant matmul, here on the CPU with the kernel's part played
    by MLX's products a row at a time: every linear layer of a 4-bit MLX folder (and the tied
    output head) is routed, the decode passes (drafts checked with them included) call it and
    the prompt passes do not, and replies are the kernel-off replies, alone, among others and
    drafted. `unroute` gives the layers their MLX classes back."""
    import sys

    import mlx.nn as nn

    from kinfer_rpc.default_plugins.mlx import matmul as mm
    from kinfer_rpc.default_plugins.mlx import routing as mlx_routing

    calls: list[int] = []
    _rows_one_by_one(monkeypatch, calls)
    from kinfer_rpc.default_plugins.mlx import attention as att

    monkeypatch.setattr(
        att,
        "attention",
        lambda q, nk, nv, k, v, s, c, sc, counter, heads=None, splits=None: att.reference(q, nk, nv, k, v, s, c, sc),
    )
    routed: list[int] = []

    def loader(drafts, on):
        def load(p):
            opts = LoadOptions(context_length=CTX, slots=3, batch=16, drafts=drafts, weights="quantized")
            m = MlxBackend().load(str(folder), opts, p)
            module = sys.modules[type(m.model.layers[0].self_attn).__module__]
            monkeypatch.setattr(module, "scaled_dot_product_attention", module.scaled_dot_product_attention)
            assert mlx_routing._route_attention(m.model)
            m._use_kernel()
            if on:
                n, left = mm.route(m.model)
                routed.append(n)
                assert not left
                m.rows_matmul = True
            return m

        return load

    def run(drafts, on, arrivals):
        e = Engine(loader(drafts, on), lambda fn: fn(), batch=16, prefix=-1)
        e.load_model()
        prompts = _prompts(e, ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time"])
        return e, run_until_done(e, [job(p, 5, drafts=drafts) for p in prompts], arrivals=arrivals)

    _, off = run(0, False, [0, 0, 0])
    assert not calls  # off: MLX's products
    e, on = run(0, True, [0, 2, 3])
    layers = e.model.model.model.layers
    assert routed[0] == 7 * len(layers) + 1  # q, k, v, o, gate, up, down a layer, and the tied head
    assert isinstance(e.model.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(e.model.model.model.embed_tokens).__name__ == "_QuantizedEmbedding"
    assert [j.generated for j in on] == [j.generated for j in off]
    assert calls and max(calls) <= 3  # decode rows only: the prompts (5 tokens and more) ran MLX's
    calls.clear()
    _, drafted = run(3, True, [0, 0, 1])
    assert [j.generated for j in drafted] == [j.generated for j in off]
    assert sum(j.accepted for j in drafted) > 0 and max(calls) > 3  # passes of k + 1 rows a sequence
    mm.unroute(e.model.model)
    assert type(e.model.model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
