"""Write a Qwen3-MoE-shaped GGUF with random weights, for placement benchmarks and tests.

    python tests/modelgen/make_moe_model.py OUT.gguf --shape 30b-a3b   # Qwen3-30B-A3B's shape, Q4_K (~17 GiB)
    python tests/modelgen/make_moe_model.py OUT.gguf --shape tiny      # 2 layers, 8 experts, F32 (for tests)

No weights can be downloaded on the GPU machine, and quantizing a 30B F16 file would take longer
than writing it: the big shape is written directly as Q4_K blocks (random 4-bit values and
scales under small f16 block scales), so no float copy of 30B weights ever exists. Speed does not
depend on the values; random router weights spread the tokens over the experts about evenly, as
a trained router does over a long prompt. Needs the `gguf` package.
"""

from __future__ import annotations

import argparse

import numpy as np
from make_model import add_spm_vocab  # a neighbour: this folder is on the path

SHAPES = {
    # Qwen3-30B-A3B: 48 layers, 128 experts (8 used), expert FFN 768, 32 query / 4 KV heads of 128
    "30b-a3b": dict(
        n_embd=2048,
        n_layer=48,
        n_head=32,
        n_kv=4,
        head_dim=128,
        n_expert=128,
        n_used=8,
        n_ff_exp=768,
        n_ff=6144,
        vocab=151936,
        quant=True,
    ),
    # the big shape's code path (Q4_K blocks) at a size that loads in a second
    "mini-q4k": dict(
        n_embd=256,
        n_layer=2,
        n_head=2,
        n_kv=1,
        head_dim=128,
        n_expert=4,
        n_used=2,
        n_ff_exp=256,
        n_ff=512,
        vocab=512,
        quant=True,
    ),
    "tiny": dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_kv=2,
        head_dim=32,
        n_expert=8,
        n_used=2,
        n_ff_exp=32,
        n_ff=128,
        vocab=512,
        quant=False,
    ),
}
QK_K, Q4_K_BYTES = 256, 144


def main():
    import gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = ap.parse_args()
    s = SHAPES[args.shape]
    e, hd, quant = s["n_embd"], s["head_dim"], s["quant"]
    rng = np.random.default_rng(0)

    if quant:
        # One pool of random Q4_K blocks; every tensor is a view of it (rows x bytes per row).
        biggest = max(s["n_expert"] * s["n_ff_exp"] * e, s["vocab"] * e) // QK_K
        pool = np.frombuffer(rng.bytes(biggest * Q4_K_BYTES), dtype=np.uint8).reshape(biggest, Q4_K_BYTES).copy()
        scales = np.array([0.00008, 0.0006], dtype=np.float16).view(np.uint8)
        # d and dmin of every block: small and finite, dmin = 7.5 d so that a weight
        # d*scale*q - dmin*min (q in 0..15, scale and min random 6-bit) averages zero. Biased
        # weights would give every token the same hidden state, hence the same 8 experts.
        pool[:, 0:4] = scales

    def weight(*shape):
        """A weight of numpy shape `shape` (ggml's reversed): Q4_K bytes or F32 values."""
        n = int(np.prod(shape))
        if not quant:
            return (rng.standard_normal(n, dtype=np.float32) * 0.05).reshape(shape), None
        cols = shape[-1]
        assert cols % QK_K == 0, (shape, "rows must be whole Q4_K blocks")
        blocks = pool.reshape(-1)[: n // QK_K * Q4_K_BYTES]
        return blocks.reshape(*shape[:-1], cols // QK_K * Q4_K_BYTES), gguf.GGMLQuantizationType.Q4_K

    w = gguf.GGUFWriter(args.out, "qwen3moe")
    w.add_name(f"synthetic-qwen3moe-{args.shape}")
    w.add_context_length(40960)
    w.add_embedding_length(e)
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["n_expert"])
    w.add_expert_used_count(s["n_used"])
    w.add_expert_feed_forward_length(s["n_ff_exp"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if quant else gguf.LlamaFileType.ALL_F32)
    add_spm_vocab(w, s["vocab"])

    def add(name, shape):
        data, raw = weight(*shape)
        w.add_tensor(name, data, raw_dtype=raw)

    ones = np.ones(e, dtype=np.float32)
    add("token_embd.weight", (s["vocab"], e))
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", (s["vocab"], e))
    nx, ff = s["n_expert"], s["n_ff_exp"]
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        add(p + "attn_q.weight", (s["n_head"] * hd, e))
        add(p + "attn_k.weight", (s["n_kv"] * hd, e))
        add(p + "attn_v.weight", (s["n_kv"] * hd, e))
        add(p + "attn_output.weight", (e, s["n_head"] * hd))
        w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, dtype=np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((nx, e), dtype=np.float32) * 0.05)
        add(p + "ffn_gate_exps.weight", (nx, ff, e))
        add(p + "ffn_up_exps.weight", (nx, ff, e))
        if quant and ff % QK_K:
            raise SystemExit("ffn_down_exps rows must be whole Q4_K blocks")
        add(p + "ffn_down_exps.weight", (nx, e, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
