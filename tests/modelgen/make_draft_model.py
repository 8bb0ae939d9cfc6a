"""Write a small random-weight Llama GGUF with another model's vocabulary: a synthetic draft model.

    python tests/modelgen/make_draft_model.py SOURCE.gguf OUT.gguf [--layers 2 --embd 128]

No smaller real model shares SmolLM2's vocabulary here, so the draft-model policy is tested and
measured with this one (fast, drafts badly) and with SmolLM2 drafting for itself (slow, drafts
perfectly). The tokenizer (every `tokenizer.*` key) is copied from SOURCE; the weights are
random. Needs the `gguf` package.
"""

from __future__ import annotations

import argparse

import numpy as np


def main():
    import gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    src = gguf.GGUFReader(args.source)
    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name("synthetic-draft")
    e, n_head = args.embd, args.heads
    hd = e // n_head
    vocab = None
    for field in src.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            w.add_array(field.name, value)
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(value)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            w.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], vtype)
    if vocab is None:
        raise SystemExit(f"{args.source} has no tokenizer.ggml.tokens")
    w.add_context_length(8192)
    w.add_embedding_length(e)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(2 * e)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.05

    ones = np.ones(e, dtype=np.float32)
    w.add_tensor("token_embd.weight", rand(vocab, e))
    w.add_tensor("output_norm.weight", ones)
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", rand(e, e))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", rand(2 * e, e))
        w.add_tensor(p + "ffn_up.weight", rand(2 * e, e))
        w.add_tensor(p + "ffn_down.weight", rand(e, 2 * e))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
