"""Write a small random-weight GGUF of an architecture the mlx backend maps onto mlx-lm, as
llama.cpp's converter lays it out, for tests that load the same file on both backends.

    python tests/modelgen/make_gguf_model.py OUT.gguf --arch qwen3moe [--type Q8_0]

Architectures (ARCHS): qwen2 (attention Q/K/V biases), qwen3 (per-head Q/K norms), qwen3moe
(experts stacked in ffn_*_exps, router ffn_gate_inp), qwen2moe (the same plus a shared expert
behind a sigmoid gate) and mixtral (written as llama.cpp's converter writes Mixtral: architecture
llama, its feed_forward_length the experts', with stacked experts and a router). Two layers of
hidden size 64; the MoE ones have 8 experts, 2 a token.
Weights are F32, or quantized to `--type` (any type gguf-py quantizes: Q4_0, Q4_1, Q8_0, Q5_0,
...; K-quant types are written as random blocks, enough for a file that only has to be refused);
norms and biases stay F32 as llama.cpp's converter keeps them. `types` (write()) overrides the
type of single tensors. The output head is drawn wider than the rest, so that greedy replies
rarely meet a near-tie (`tied`: no output head, the token embedding serves). The tokenizer is
SmolLM2's (copied from the embedded GGUF), so the file loads on both backends.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = ("qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral")
SHAPE = dict(n_embd=64, n_layer=2, n_head=4, n_kv=2, head_dim=16, n_ff=256, n_expert=8, n_used=2, n_ff_exp=32)
_K_BLOCK = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes a 256-weight block


def _tokenizer(w: Any) -> None:
    """SmolLM2's byte-level BPE vocabulary, merges and special tokens, from the embedded GGUF."""
    import gguf

    from kinfer_rpc.host.store import embedded_default_path

    r = gguf.GGUFReader(embedded_default_path())

    def get(key: str) -> Any:
        return r.fields[key].contents()

    w.add_tokenizer_model(get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    w.add_token_list(get("tokenizer.ggml.tokens"))
    w.add_token_types(get("tokenizer.ggml.token_type"))
    w.add_token_merges(get("tokenizer.ggml.merges"))
    w.add_bos_token_id(get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(get("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(get("tokenizer.chat_template"))


def write(
    out: str | Path,
    arch: str,
    qtype: str = "F32",
    types: dict[str, str] | None = None,
    seed: int = 0,
    tied: bool = False,
) -> Path:
    """Write the GGUF; `qtype` for every matrix, `types` (tensor name -> type) for single ones;
    `tied`: no output.weight, the head is the token embedding (as the small Qwen3 models have it)."""
    import gguf
    from gguf import quants

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")
    s, types = SHAPE, types or {}
    e, hd, nx, ff = s["n_embd"], s["head_dim"], s["n_expert"], s["n_ff_exp"]
    vocab = 49152
    rng = np.random.default_rng(seed)
    moe = arch.endswith("moe") or arch == "mixtral"

    w = gguf.GGUFWriter(str(out), "llama" if arch == "mixtral" else arch)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(4096)
    w.add_embedding_length(e)
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(ff if arch == "mixtral" else s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        w.add_expert_count(nx)
        w.add_expert_used_count(s["n_used"])
        if arch != "mixtral":  # (Mixtral's converter writes the experts' width as feed_forward_length)
            w.add_expert_feed_forward_length(ff)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(2 * ff)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(w)

    def matrix(name: str, *shape: int, scale: float = 0.1) -> None:
        """A weight of numpy shape `shape` (ggml's reversed), in its type."""
        data = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
        t = types.get(name, qtype)
        if t == "F32":
            w.add_tensor(name, data)
        elif t in _K_BLOCK:
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            assert cols % 256 == 0, (name, "rows must be whole 256-weight blocks")
            raw = np.frombuffer(rng.bytes(rows * cols // 256 * _K_BLOCK[t]), dtype=np.uint8)
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[t])
        else:
            qt = gguf.GGMLQuantizationType[t]
            w.add_tensor(name, quants.quantize(data, qt), raw_dtype=qt)

    def vector(name: str, n: int, mean: float = 0.0, scale: float = 0.1) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n, dtype=np.float32) * scale).astype(np.float32))

    matrix("token_embd.weight", vocab, e, scale=1.0)
    vector("output_norm.weight", e, 1.0)
    if not tied:
        matrix("output.weight", vocab, e, scale=0.5)
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", e, 1.0)
        matrix(p + "attn_q.weight", s["n_head"] * hd, e)
        matrix(p + "attn_k.weight", s["n_kv"] * hd, e)
        matrix(p + "attn_v.weight", s["n_kv"] * hd, e)
        matrix(p + "attn_output.weight", e, s["n_head"] * hd)
        if arch in ("qwen2", "qwen2moe"):
            vector(p + "attn_q.bias", s["n_head"] * hd)
            vector(p + "attn_k.bias", s["n_kv"] * hd)
            vector(p + "attn_v.bias", s["n_kv"] * hd)
        elif arch != "mixtral":
            vector(p + "attn_q_norm.weight", hd, 1.0)
            vector(p + "attn_k_norm.weight", hd, 1.0)
        vector(p + "ffn_norm.weight", e, 1.0)
        if not moe:
            matrix(p + "ffn_gate.weight", s["n_ff"], e)
            matrix(p + "ffn_up.weight", s["n_ff"], e)
            matrix(p + "ffn_down.weight", e, s["n_ff"])
            continue
        # the router in F32, as llama.cpp's converter keeps it; drawn wide so that the experts
        # a token picks are clear of ties
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((nx, e), dtype=np.float32))
        matrix(p + "ffn_gate_exps.weight", nx, ff, e)
        matrix(p + "ffn_up_exps.weight", nx, ff, e)
        matrix(p + "ffn_down_exps.weight", nx, e, ff)
        if arch == "qwen2moe":
            vector(p + "ffn_gate_inp_shexp.weight", e)
            matrix(p + "ffn_gate_shexp.weight", 2 * ff, e)
            matrix(p + "ffn_up_shexp.weight", 2 * ff, e)
            matrix(p + "ffn_down_shexp.weight", e, 2 * ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--arch", choices=ARCHS, default="qwen3")
    ap.add_argument("--type", default="F32", help="type of the matrices: F32, Q4_0, Q4_1, Q8_0, ...")
    ap.add_argument("--tied", action="store_true", help="no output.weight: the head is the token embedding")
    args = ap.parse_args()
    write(args.out, args.arch, args.type, tied=args.tied)


if __name__ == "__main__":
    main()
