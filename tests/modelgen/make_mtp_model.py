"""Write a tiny GGUF with a multi-token-prediction (NextN) block, for the `mtp` draft policy.

    python tests/modelgen/make_mtp_model.py OUT.gguf [--aligned] [--embd 128] [--trunk 2] [--seed 0]

The architecture is `glm4moe` (GLM-4.5's, llama.cpp's reference MTP model): `--trunk` dense
blocks, then one NextN block (block index `trunk`: `nextn_predict_layers` = 1, MoE FFN as
llama.cpp's MTP graph requires, `nextn.eh_proj` / `enorm` / `hnorm` / `shared_head_norm`; the
embedding and output head are the model's own). Matrices are Q8_0 (norms, biases and the
token embeddings float32): with float32 matrices llama.cpp's CPU backend takes a different
matrix kernel for a many-row pass than for one row, so logits would depend on how a pass was
batched; with Q8_0 they are the same, as for the real models the engine's tests use.

- default: random weights. The MTP head's guesses have nothing to do with the target's, so
  nearly every draft is rejected (what a reply must survive unchanged).
- `--aligned`: the residual stream is rigged to one direction whose output row is token 300, in
  the trunk and in the NextN block alike, so the target and the MTP head both always predict
  token 300 and every draft is accepted.

The vocabulary is SentencePiece-style (3 specials, 256 byte tokens, filler pieces), 512 tokens;
head size = embd / 4 (128 gives 32: q8_0 KV cells need a multiple of 32). Needs the `gguf`
package (`pip install gguf`, in the test extra).
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import quants
from make_model import add_spm_vocab  # a neighbour: this folder is on the path

ALIGNED_TOKEN = 300
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def write(out: str, *, aligned: bool = False, vocab: int = 512, embd: int = 128, trunk: int = 2, seed: int = 0) -> None:
    V, E = vocab, embd
    n_head, n_kv, hd = 4, 2, embd // 4
    n_ff = 2 * E  # dense trunk FFN
    n_expert, n_expert_used, n_ff_exp, n_shared = 4, 2, E // 2, 1
    n_all = trunk + 1  # the NextN block is the last one
    rng = np.random.default_rng(seed)

    def rand(*shape, scale):  # numpy shape = reversed ggml ne
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    w = gguf.GGUFWriter(out, "glm4moe")
    w.add_name("synthetic-glm4moe-mtp" + ("-aligned" if aligned else ""))
    w.add_context_length(2048)
    w.add_embedding_length(E)
    w.add_block_count(n_all)  # includes the NextN block
    w.add_nextn_predict_layers(1)
    w.add_leading_dense_block_count(trunk)  # the trunk is dense: a plain KV cache
    w.add_feed_forward_length(n_ff)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_shared_count(n_shared)
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(1.0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd // 2)  # GLM's partial rotary
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)

    add_spm_vocab(w, V)

    if aligned:
        # Every embedding ~ one direction c, layers nearly silent: the stream stays ~c, and
        # output row ALIGNED_TOKEN is c, so it wins every argmax.
        c = rng.standard_normal(E).astype(np.float32)
        tok_embd = c[None, :] + rand(V, E, scale=0.05)
        out_w = rand(V, E, scale=0.1)
        out_w[ALIGNED_TOKEN] = c
        lw = 0.01
    else:
        tok_embd, out_w, lw = rand(V, E, scale=1.0), rand(V, E, scale=0.1), 0.1
    add = w.add_tensor

    def matrix(name, data):  # Q8_0 blocks of 32 along each row (the last numpy axis)
        add(name, quants.quantize(data, Q8_0), raw_dtype=Q8_0)

    w.add_tensor("token_embd.weight", tok_embd)
    w.add_tensor("output_norm.weight", ones(E))
    matrix("output.weight", out_w)

    for i in range(n_all):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(E))
        matrix(p + "attn_q.weight", rand(n_head * hd, E, scale=lw))
        matrix(p + "attn_k.weight", rand(n_kv * hd, E, scale=lw))
        matrix(p + "attn_v.weight", rand(n_kv * hd, E, scale=lw))
        w.add_tensor(p + "attn_q.bias", rand(n_head * hd, scale=0.01))
        w.add_tensor(p + "attn_k.bias", rand(n_kv * hd, scale=0.01))
        w.add_tensor(p + "attn_v.bias", rand(n_kv * hd, scale=0.01))
        matrix(p + "attn_output.weight", rand(E, n_head * hd, scale=lw))
        w.add_tensor(p + "post_attention_norm.weight", ones(E))
        if i < trunk:
            matrix(p + "ffn_gate.weight", rand(n_ff, E, scale=lw))
            matrix(p + "ffn_up.weight", rand(n_ff, E, scale=lw))
            matrix(p + "ffn_down.weight", rand(E, n_ff, scale=lw))
            continue
        # The NextN block: MoE FFN (llama.cpp's MTP graph asserts ffn_gate_inp) ...
        matrix(p + "ffn_gate_inp.weight", rand(n_expert, E, scale=lw))
        w.add_tensor(p + "exp_probs_b.bias", np.zeros(n_expert, dtype=np.float32))
        matrix(p + "ffn_gate_exps.weight", rand(n_expert, n_ff_exp, E, scale=lw))
        matrix(p + "ffn_up_exps.weight", rand(n_expert, n_ff_exp, E, scale=lw))
        matrix(p + "ffn_down_exps.weight", rand(n_expert, E, n_ff_exp, scale=lw))
        matrix(p + "ffn_gate_shexp.weight", rand(n_ff_exp * n_shared, E, scale=lw))
        matrix(p + "ffn_up_shexp.weight", rand(n_ff_exp * n_shared, E, scale=lw))
        matrix(p + "ffn_down_shexp.weight", rand(E, n_ff_exp * n_shared, scale=lw))
        # ... and what makes it a NextN block: eh_proj maps [enorm(token), hnorm(hidden)] to E.
        if aligned:  # [I, 0.5 I]: keeps the common direction
            eh = np.concatenate([np.eye(E), 0.5 * np.eye(E)], axis=1).astype(np.float32)
        else:
            eh = rand(E, 2 * E, scale=lw)
        matrix(p + "nextn.eh_proj.weight", eh)
        w.add_tensor(p + "nextn.enorm.weight", ones(E))
        w.add_tensor(p + "nextn.hnorm.weight", ones(E))
        w.add_tensor(p + "nextn.shared_head_norm.weight", ones(E))
        # nextn.embed_tokens / nextn.shared_head_head are optional: token_embd / output are used

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument(
        "--aligned",
        action="store_true",
        help=f"target and MTP head both always predict token {ALIGNED_TOKEN} (every draft accepted)",
    )
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--trunk", type=int, default=2, help="dense blocks before the NextN block")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write(a.out, aligned=a.aligned, vocab=a.vocab, embd=a.embd, trunk=a.trunk, seed=a.seed)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
