"""GGUF files beyond llama on the mlx backend, on the CPU: qwen2 (attention biases), qwen3 (per-head
Q/K norms), qwen3moe and qwen2moe (stacked experts, qwen2moe's shared expert), as small
random-weight GGUFs (tests/modelgen/make_gguf_model.py) in F32, F16, BF16 and the block types
mx.load keeps quantized, each loaded on the mlx backend and on llama.cpp from the same file; and
the clear refusal of a tensor type mx.load cannot read.

F32 weights: llama.cpp's CPU matmul then computes in float32 as MLX does, only its KV cells are
float16, so logits agree within 0.05 (they span about 40; the interleaved rope layout in place
of the qwen families' halves layout is off by about 3) and greedy replies are identical.
Other weights: llama.cpp rounds activations to 8 bits for its block dot products (to 16 bits
for F16 and BF16), so logits agree in correlation (above 0.999) and in the top token wherever
llama.cpp's best two are clear.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kinfer_rpc.default_plugins.llama import LlamaBackend  # noqa: E402
from kinfer_rpc.default_plugins.mlx import MlxBackend  # noqa: E402
from kinfer_rpc.types import LoadOptions, SeqChunk  # noqa: E402

pytestmark = pytest.mark.model  # every test here loads a real model

CTX = 128
ARCHS = ("qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral")  # mixtral: a llama GGUF with experts
# each architecture in one of the quantized types, every type mx.load reads covered; one with the
# output head tied to the token embedding (no output.weight), as the small Qwen3 models have it
ROUNDED = [
    ("qwen2", "Q8_0", False),
    ("qwen3", "Q4_1", False),
    ("qwen3moe", "Q4_0", False),
    ("qwen2moe", "Q8_0", False),
    ("mixtral", "Q4_0", False),
    ("qwen3", "F16", True),
    ("qwen3moe", "BF16", False),
]
PROMPT = "<|im_start|>user\nWhat is the capital of France? Tell me about Paris.<|im_end|>\n<|im_start|>assistant\n"
N = 8  # greedy tokens a reply


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@functools.cache
def _gguf(root: Path, arch: str, qtype: str, tied: bool = False) -> str:
    import make_gguf_model

    out = root / f"{arch}-{qtype}{'-tied' if tied else ''}.gguf"
    return str(make_gguf_model.write(out, arch, qtype, seed=len(arch), tied=tied))


def _llama(path: str):
    return LlamaBackend().load(path, LoadOptions(context_length=CTX, slots=1, threads=2, kv_type="f16"), lambda f: None)


def _mlx(path: str, weights: str | None = None):
    return MlxBackend().load(path, LoadOptions(context_length=CTX, slots=1, weights=weights), lambda f: None)


def _prompt_logits(m, tokens: list[int]) -> np.ndarray:
    m.seq_remove(0)
    out = np.array(m.decode([SeqChunk(0, 0, tokens, len(tokens))])(), copy=True)
    m.seq_remove(0)
    return out


def _greedy(m, tokens: list[int], n: int) -> list[int]:
    """n argmax tokens after `tokens`, one decode pass a token."""
    m.seq_remove(0)
    logits = m.decode([SeqChunk(0, 0, tokens, 1)])()
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = m.decode([SeqChunk(0, len(tokens) + len(out) - 1, [out[-1]], 1)])()
    m.seq_remove(0)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_matches_llama_cpp(root, arch):
    path = _gguf(root, arch, "F32")
    ref, m = _llama(path), _mlx(path)
    assert m.config["model_type"] == {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(arch, arch)
    tokens = ref.tokenize(PROMPT, True, True)
    assert m.tokenize(PROMPT, True, True) == tokens
    a, b = _prompt_logits(m, tokens), _prompt_logits(ref, tokens)
    assert a.shape == b.shape == (len(tokens), 49152)
    assert b.max() - b.min() > 20  # a head wide enough that the comparison means something
    assert np.abs(a - b).max() < 0.05
    assert _greedy(m, tokens, N) == _greedy(ref, tokens, N)


@pytest.mark.parametrize(("arch", "qtype", "tied"), ROUNDED)
def test_quantized_gguf_matches_llama_cpp(root, arch, qtype, tied):
    """The block types mx.load keeps quantized, run as stored (MLX's quantized matmul, the
    experts' gathered one for a MoE) and expanded to float32 at load; F16 and BF16 (which mx.load
    reads as float16), expanded to float32."""
    path = _gguf(root, arch, qtype, tied)
    ref = _llama(path)
    tokens = ref.tokenize(PROMPT, True, True)
    b = _prompt_logits(ref, tokens)
    top2 = np.sort(b, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= len(tokens) // 2
    for form in ("quantized", "dense") if qtype.startswith("Q") else ("dense",):
        m = _mlx(path, form)
        assert m.weights == form
        assert m.config["tie_word_embeddings"] == tied
        a = _prompt_logits(m, tokens)
        assert min(np.corrcoef(a[i], b[i])[0, 1] for i in range(len(tokens))) > 0.999, form
        assert (a.argmax(1) == b.argmax(1))[clear].all(), form
        assert np.abs(a - b).mean() < 0.1, form


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_unsupported_tensor_type_is_refused_by_name(root, qtype):
    """A tensor of a type mx.load cannot read (it would fail with no tensor named) is refused
    before any weight is read: the error names the tensor, its type and the types read."""
    import make_gguf_model

    path = make_gguf_model.write(root / f"qwen3-{qtype}.gguf", "qwen3", types={"blk.1.ffn_down.weight": qtype})
    with pytest.raises(ValueError) as exc:
        _mlx(str(path))
    msg = str(exc.value)
    assert f"blk.1.ffn_down.weight is {qtype}" in msg
    assert "F32, F16, BF16, Q4_0, Q4_1, Q8_0" in msg
    assert "llama backend" in msg


def test_unmapped_architecture_is_refused(root):
    """An architecture with no mapping onto mlx-lm is refused from the header, naming it."""
    import gguf

    path = root / "phi3.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="not 'phi3'; load this model with the llama backend"):
        _mlx(str(path))


def test_a_llama_gguf_with_experts_not_laid_out_as_mixtral_is_refused(root, monkeypatch):
    """A llama file with experts whose heads are not hidden / heads wide (which llama.cpp runs, and
    mlx-lm's mixtral cannot) is refused by a sentence that names the llama backend, not a shape error."""
    import make_gguf_model

    monkeypatch.setitem(make_gguf_model.SHAPE, "head_dim", 8)  # 4 heads of 8 in a hidden size of 64
    path = make_gguf_model.write(root / "mixtral-narrow.gguf", "mixtral")
    with pytest.raises(ValueError, match="not laid out as Mixtral.*llama backend"):
        _mlx(str(path))


@pytest.mark.parametrize(("arch", "qtype"), [("qwen3moe", "Q4_0"), ("qwen2moe", "F32"), ("mixtral", "Q8_0")])
def test_moe_gguf_replies_alone_equal_among_others(root, arch, qtype):
    """A MoE GGUF on the engine (its experts quantized as stored, or float): each greedy reply to
    prompts of mixed lengths is the same alone and among the others, all at once or arriving
    over steps."""
    from engine_helpers import run_until_done

    from kinfer_rpc.engine.job import GenerateOptions, Job
    from kinfer_rpc.engine.sampling import SamplingOptions
    from kinfer_rpc.engine.scheduler import Engine

    path = _gguf(root, arch, qtype)
    opts = LoadOptions(context_length=CTX, slots=4, batch=64, drafts=0, weights="quantized" if qtype != "F32" else None)
    e = Engine(lambda p: MlxBackend().load(path, opts, p), lambda fn: fn(), batch=64, prefix=-1)
    e.load_model()

    def job(p: list[int]) -> Job:
        return Job(list(p), GenerateOptions(max_tokens=N, sampling=SamplingOptions(temperature=0.0)))

    texts = ["Hi", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", PROMPT]
    prompts = [e.model.tokenize(t, True, True) for t in texts]
    solo = [run_until_done(e, [job(p)])[0].generated for p in prompts]
    assert len({t for r in solo for t in r}) > N  # replies, not one token over and over
    for arrivals in ([0, 0, 0, 0], [0, 1, 1, 3]):
        assert [j.generated for j in run_until_done(e, [job(p) for p in prompts], arrivals=arrivals)] == solo
