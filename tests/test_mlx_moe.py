"""Mixture-of-experts models on the mlx backend, on the CPU: every MoE family of mlx-lm's the
backend is tested with (qwen3_moe, qwen2_moe, mixtral, deepseek_v2, deepseek_v3), as small
random-weight MLX folders (tests/modelgen/make_mlx_moe_model.py), float16 and 4-bit.

Each reply is checked against mlx-lm's own greedy generation (mlx_lm.generate.generate_step with an
argmax sampler) of the same prompt tokens, and against itself alone when it runs among others. The
reference runs mlx-lm's model with its float parameters in float32, as the mlx backend runs them on
the CPU (MLX's float16 kernels are emulated there), so that both compute the same numbers.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from engine_helpers import mlx_kernel_engine, run_until_done  # noqa: E402
from protocol_fixtures import server, spawn  # noqa: E402,F401

from kinfer_rpc.default_plugins import drafts as kinfer_drafts  # noqa: E402
from kinfer_rpc.default_plugins.mlx import MlxBackend  # noqa: E402
from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.sampling import SamplingOptions  # noqa: E402
from kinfer_rpc.engine.scheduler import Engine  # noqa: E402
from kinfer_rpc.host.store import ModelStore  # noqa: E402
from kinfer_rpc.types import LoadOptions  # noqa: E402

pytestmark = pytest.mark.model  # every test here loads a real model

CTX = 256
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")
QUANTIZED = ("qwen3_moe", "deepseek_v3")  # also written 4-bit, group 32
TEXTS = [
    "Hi",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Once upon a time, in a land far away, there lived a",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nWhat is the capital of France? Tell me about Paris.<|im_end|>\n<|im_start|>assistant\n",
]
N = 8  # tokens a reply


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """name -> folder: every family in float16, and QUANTIZED's families 4-bit as `<family>-4bit`."""
    import make_mlx_moe_model

    root = tmp_path_factory.mktemp("moe")
    out = {f: make_mlx_moe_model.write(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}
    for f in QUANTIZED:
        out[f"{f}-4bit"] = make_mlx_moe_model.write(root / f"{f}-4bit", f, bits=4, group=32, seed=7)
    return out


def engine(path: Path, slots: int = 8, drafts: int = 0, weights: str | None = None) -> Engine:
    opts = LoadOptions(context_length=CTX, slots=slots, batch=64, drafts=drafts, weights=weights)
    e = Engine(lambda p: MlxBackend().load(str(path), opts, p), lambda fn: fn(), batch=64, prefix=-1)
    e.load_model()
    return e


@functools.lru_cache(maxsize=1)
def ngram():
    found = []
    kinfer_drafts.register_draft_policies(found.append)
    return found[0]


def job(prompt, n=N, temperature=0.0, seed=1, drafts=0) -> Job:
    return Job(
        list(prompt),
        GenerateOptions(
            max_tokens=n,
            drafts=drafts,
            draft_policy=ngram() if drafts else None,
            sampling=SamplingOptions(temperature=temperature, seed=seed),
        ),
    )


def mlx_lm_greedy(path: Path, prompts: list[list[int]], n: int = N) -> list[list[int]]:
    """mlx-lm's own greedy tokens for each prompt: its load, its generate_step, an argmax sampler."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model = load(str(path))[0]
    model.update(
        tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters())
    )
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n, sampler=argmax)] for p in prompts]


def _check_family(path: Path, weights: str | None = None) -> None:
    e = engine(path, weights=weights)
    if weights:
        assert e.model.info.weights == weights
    assert e.model.info.architecture == json.loads((path / "config.json").read_text())["model_type"]
    prompts = [e.model.tokenize(t, True, True) for t in TEXTS]
    assert len({len(p) for p in prompts}) >= 5  # mixed lengths, 1 to 26 tokens
    solo = [run_until_done(e, [job(p)])[0].generated for p in prompts]
    assert solo == mlx_lm_greedy(path, prompts)
    assert len({t for r in solo for t in r}) > 3 * N  # replies, not one token over and over
    # Among others: all at once and arriving over steps, greedy beside seeded sampling.
    seeded = [run_until_done(e, [job(p, temperature=0.8, seed=10 + i)])[0].generated for i, p in enumerate(prompts)]
    for arrivals in ([0] * 8, [0, 0, 1, 1, 2, 3, 3, 5]):
        jobs = [job(p) for p in prompts] + [job(p, temperature=0.8, seed=10 + i) for i, p in enumerate(prompts[:2])]
        together = run_until_done(e, jobs, arrivals=arrivals)
        assert [j.generated for j in together] == solo + seeded[:2]
    together = run_until_done(e, [job(p, temperature=0.8, seed=10 + i) for i, p in enumerate(prompts)])
    assert [j.generated for j in together] == seeded


@pytest.mark.parametrize("family", FAMILIES)
def test_replies_are_mlx_lm_s_greedy_tokens_alone_and_among_others(folders, family):
    """The float16 folder (run as float32 on the CPU): greedy replies to prompts of mixed lengths
    are mlx-lm's own greedy tokens, and every reply (greedy or seeded) is the same alone and
    among 6-8 others, all at once or arriving over steps."""
    _check_family(folders[family])


@pytest.mark.parametrize("family", QUANTIZED)
def test_quantized_replies_are_mlx_lm_s_greedy_tokens_alone_and_among_others(folders, family):
    """The 4-bit folder run quantized (experts as quantized switch layers): the same checks against
    mlx-lm running the same quantized weights; loaded dense (the CPU default for a small model) it
    generates too, the experts expanded."""
    path = folders[f"{family}-4bit"]
    _check_family(path, weights="quantized")
    dense = engine(path, slots=1)
    assert dense.model.info.weights == "dense"
    (j,) = run_until_done(dense, [job(dense.model.tokenize(TEXTS[1], True, True))])
    assert len(j.generated) == N


def test_drafts_change_no_reply(folders):
    """n-gram drafts (decode rows of several tokens, the latent-attention families' other path):
    every family's greedy replies are those without drafts. The prompts repeat themselves and
    their own reply, so that the n-gram policy finds drafts."""
    drafted = 0
    for family in FAMILIES:
        plain, d = engine(folders[family], slots=3), engine(folders[family], slots=3, drafts=4)
        prompts = [plain.model.tokenize(t, True, True) for t in TEXTS[1:4]]
        prompts = [p + run_until_done(plain, [job(p, 10)])[0].generated + p for p in prompts]
        solo = [run_until_done(plain, [job(p, 10)])[0].generated for p in prompts]
        jobs = run_until_done(d, [job(p, 10, drafts=4) for p in prompts], arrivals=[0, 0, 1])
        assert [j.generated for j in jobs] == solo, family
        drafted += sum(j.drafted for j in jobs)
    assert drafted > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_attention_kernel_route_and_no_row_invariant_matmul(folders, family, monkeypatch):
    """On CUDA these families' decode attention is kinfer's kernel (their head runs only on the
    rows that ask for logits); here on the CPU with the kernel's part played by MLX's own
    operations, routed as on the GPU: greedy replies among others and drafted are the kernel-off
    replies alone. The row-invariant matmul is not routed for them: their experts' gathered
    products stay MLX's, so a load would refuse it (the check passed, the layers given back)."""
    from kinfer_rpc.default_plugins.mlx import matmul as mm

    plain = engine(folders[family], slots=3)
    prompts = [plain.model.tokenize(t, True, True) for t in TEXTS[1:4]]
    solo = [run_until_done(plain, [job(p)])[0].generated for p in prompts]
    calls: list[int] = []
    e = mlx_kernel_engine(monkeypatch, folders[family], calls, batch=64, context_length=CTX, slots=3)
    assert e.model.split_head
    assert [j.generated for j in run_until_done(e, [job(p) for p in prompts], arrivals=[0, 1, 3])] == solo
    assert calls  # the compiled decode passes went through the kernel's route
    d = mlx_kernel_engine(monkeypatch, folders[family], calls, drafts=4, batch=64, context_length=CTX, slots=3)
    drafted = run_until_done(d, [job(p, drafts=4) for p in prompts], arrivals=[0, 0, 1])
    assert [j.generated for j in drafted] == solo
    monkeypatch.setattr(mm, "self_check", lambda *a: (0.0, True))  # a kernel that passes its checks
    on, why = mm.prepare(e.model.model)
    assert not on and "does not take" in why
    swapped = (mm._QuantizedLinear, mm._Linear, mm._QuantizedEmbedding, mm._Embedding)
    assert not any(type(m) in swapped for _, m in e.model.model.named_modules())  # given back


def test_ollama_safetensors_manifest_loads(folders, tmp_path, monkeypatch):
    """The 4-bit qwen3_moe folder's tensors as an Ollama safetensors model (one blob per tensor
    with its scales and biases, json layers for the config and tokenizer): mlx-lm's model built
    from them quantizes the experts and the router as stored and answers the folder's tokens."""
    import mlx.core as mx

    folder = folders["qwen3_moe-4bit"]
    store = tmp_path / "ollama"
    (store / "blobs").mkdir(parents=True)
    layers = []

    def blob(data: bytes, media: str, name: str) -> None:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (store / "blobs" / digest.replace(":", "-")).write_bytes(data)
        layers.append({"mediaType": media, "digest": digest, "size": len(data), "name": name})

    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    assert any(".switch_mlp." in k and k.endswith(".scales") for k in weights)  # the experts are quantized
    for name in sorted(k for k in weights if not k.endswith((".scales", ".biases"))):
        base = name.rsplit(".", 1)[0]
        group = {k: weights[k] for k in weights if k == name or k.rsplit(".", 1)[0] == base}
        one = tmp_path / "one.safetensors"
        mx.save_safetensors(str(one), group)
        blob(one.read_bytes(), "application/vnd.ollama.image.tensor", name)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        blob((folder / f).read_bytes(), "application/vnd.ollama.image.json", f)
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tinymoe" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    ref = ModelStore().resolve("tinymoe")
    assert ref.format == "mlx"
    e = engine(Path(ref.path), slots=2, weights="quantized")
    assert e.model.info.architecture == "qwen3_moe"
    prompts = [e.model.tokenize(t, True, True) for t in TEXTS[1:3]]
    assert [j.generated for j in run_until_done(e, [job(p) for p in prompts])] == mlx_lm_greedy(folder, prompts)


def test_over_the_protocol(spawn, folders):  # noqa: F811
    """The real server: a float16 deepseek_v3 folder and the 4-bit qwen3_moe one load on the mlx
    backend by themselves; inference/generate's greedy replies are mlx-lm's own tokens, and the
    same (greedy and seeded) sent one at a time and all at once."""
    c = spawn()
    c.initialize()
    for name, weights in (("deepseek_v3", None), ("qwen3_moe-4bit", "quantized")):
        model = str(folders[name])
        options = {"slots": 4, "contextLength": CTX, **({"weights": weights} if weights else {})}
        loaded = c.call("model/load", {"model": model, "options": options}, timeout=120)
        assert loaded["backend"] == "mlx"
        requests = [
            {
                "model": model,
                "prompt": t,
                "options": {"maxTokens": N, "temperature": 0.8 if i % 3 == 2 else 0, "seed": i},
            }
            for i, t in enumerate(TEXTS[1:5])
        ]
        alone = [c.call("inference/generate", r, timeout=120)["tokens"] for r in requests]
        ids = [c.request_async("inference/generate", r) for r in requests]
        together = [c.response(rid, timeout=120)["result"]["tokens"] for rid in ids]
        assert together == alone
        greedy = [i for i, r in enumerate(requests) if r["options"]["temperature"] == 0]
        tokenizer = engine(folders[name], slots=1).model
        prompts = [tokenizer.tokenize(requests[i]["prompt"], False, True) for i in greedy]
        assert [alone[i] for i in greedy] == mlx_lm_greedy(folders[name], prompts)
        c.call("model/unload", {"model": model})
