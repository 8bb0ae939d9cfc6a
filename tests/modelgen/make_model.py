"""Write a Llama-shaped GGUF with random weights (F16), for benchmarks where no weights can be
downloaded. Quantize it afterwards with llama-quantize.

    python tests/modelgen/make_model.py OUT.gguf --shape 1b|7b|7.4b [--type F16|Q8_0|Q4_0|Q4_1]

--type quantizes the matrices here (gguf's own quantizers, slow beyond the tiny shape: use
llama-quantize for the large ones); norms stay F32.

Needs the `gguf` package (llama.cpp vendors it as gguf-py). Speed does not depend on the values,
so every tensor reuses slices of one random block.
"""

from __future__ import annotations

import argparse

import numpy as np

SHAPES = {
    # TinyLlama-1.1B's shape (Llama 2 family, 32k vocabulary)
    "1b": dict(n_embd=2048, n_layer=22, n_head=32, n_kv=4, n_ff=5632, vocab=32000),
    "tiny": dict(n_embd=256, n_layer=2, n_head=4, n_kv=2, n_ff=512, vocab=32000),
    # Llama-2-7B's shape
    "7b": dict(n_embd=4096, n_layer=32, n_head=32, n_kv=32, n_ff=11008, vocab=32000),
    # The 7.4B shape of the mlx backend's benchmarks (bench/gpu_mlx.sh, Llama 3 8B's layers)
    "7.4b": dict(n_embd=4096, n_layer=32, n_head=32, n_kv=8, n_ff=14336, vocab=128256),
}


def add_spm_vocab(w, size: int) -> None:
    """A SentencePiece-style vocabulary of `size` tokens: <unk> <s> </s>, the 256 byte tokens,
    then filler pieces (any text tokenizes, through the byte tokens)."""
    import gguf

    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    tokens += [f"\u2581t{i}".encode() for i in range(size - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (size - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * size)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # gguf.LlamaFileType.MOSTLY_*


def main():
    import gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--type", choices=sorted(FILE_TYPES), default="F16", help="the matrices' type")
    args = ap.parse_args()
    qtype = getattr(gguf.GGMLQuantizationType, args.type)
    s = SHAPES[args.shape]
    e, hd = s["n_embd"], s["n_embd"] // s["n_head"]
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(64 * 1024 * 1024, dtype=np.float32) * 0.02).astype(np.float16)

    def rand(*shape):
        n = int(np.prod(shape))
        reps = -(-n // block.size)
        return np.tile(block, reps)[:n].reshape(shape) if reps > 1 else block[:n].reshape(shape).copy()

    def matrix(name, *shape):
        data = rand(*shape)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name(f"synthetic-llama-{args.shape}")
    w.add_context_length(4096)
    w.add_embedding_length(e)
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_kv"])
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(FILE_TYPES[args.type])
    add_spm_vocab(w, s["vocab"])

    ones = np.ones(e, dtype=np.float32)
    matrix("token_embd.weight", s["vocab"], e)
    w.add_tensor("output_norm.weight", ones)
    matrix("output.weight", s["vocab"], e)
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        matrix(p + "attn_q.weight", e, e)
        matrix(p + "attn_k.weight", s["n_kv"] * hd, e)
        matrix(p + "attn_v.weight", s["n_kv"] * hd, e)
        matrix(p + "attn_output.weight", e, e)
        w.add_tensor(p + "ffn_norm.weight", ones)
        matrix(p + "ffn_gate.weight", s["n_ff"], e)
        matrix(p + "ffn_up.weight", s["n_ff"], e)
        matrix(p + "ffn_down.weight", e, s["n_ff"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
