"""Write an MLX model folder (config.json, model.safetensors, tokenizer files) with mlx-lm's own
save functions, for machines that cannot download one.

    python tests/modelgen/make_mlx_model.py OUT --hidden 4096 --layers 32 --heads 32 --kv-heads 8 \\
        --intermediate 14336 --vocab 49152 --bits 4          # a random-weight 7.4B Llama shape
    python tests/modelgen/make_mlx_model.py OUT --from-gguf [PATH]    # the embedded SmolLM2 GGUF, re-quantized

Random weights: mlx-lm's llama model, its own initialisation, quantized by mlx_lm.utils.quantize_model
(affine, group 64). The tokenizer is SmolLM2's (from the embedded GGUF, rebuilt as tokenizer.json);
a vocabulary larger than its 49152 tokens is padded with added tokens `<|extra_N|>`.
`--from-gguf` dequantizes the GGUF's Q4_1/Q8_0 tensors and quantizes them again mlx-lm's way; its
config keeps the interleaved rope layout llama.cpp's tensors are stored in (rope_traditional).

`--draft-pair DRAFT --draft-layers N`: a target and a draft model that agree by construction,
for measuring drafting with drafts that are accepted (random weights otherwise accept none).
Every layer of the target after the first N writes nothing to the residual stream (its attention
output and MLP down projections are zero), so the target's logits are those of its first N layers
and the head; DRAFT gets exactly those (N layers, the same embeddings, norm and head). The target
still computes all its layers: a pass costs what it costs the plain random model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.utils import dequantize_model, quantize_model, save_config, save_model

from kinfer_rpc.default_plugins import mlx as kinfer_mlx
from kinfer_rpc.default_plugins.mlx import loading as mlx_loading
from kinfer_rpc.host.store import embedded_default_path


def write_tokenizer(out: Path, vocab: kinfer_mlx.Vocab, size: int) -> None:
    spec = json.loads(json.dumps(vocab.spec))
    n = len(spec["model"]["vocab"])
    spec["added_tokens"] += [
        {
            "id": i,
            "content": f"<|extra_{i}|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(n, size)
    ]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    text = lambda t: vocab.pieces[t].decode("utf-8", "replace") if t is not None else None  # noqa: E731
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(vocab.bos),
        "eos_token": text(vocab.eos[0] if vocab.eos else None),
        "add_bos_token": vocab.add_bos,
        "chat_template": vocab.template,
        "model_max_length": 8192,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))


def from_gguf(out: Path, gguf: str, bits: int, group: int) -> None:
    model, config, vocab, _ = mlx_loading._load_gguf(gguf)
    model = dequantize_model(model)
    config.pop("quantization", None)
    config["tie_word_embeddings"] = not hasattr(model, "lm_head")
    model, config = quantize_model(model, config, group_size=group, bits=bits)
    save_model(out, model)
    save_config(config, out / "config.json")
    write_tokenizer(out, vocab, config["vocab_size"])


def random_llama(out: Path, a) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "intermediate_size": a.intermediate,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": a.vocab,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }
    mx.random.seed(a.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Layer by layer to float16 and quantized, so a 7B shape never holds all of its float32 copy.
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    for layer in model.layers[a.draft_layers :] if a.draft_pair else []:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model, config = quantize_model(model, config, group_size=a.group, bits=a.bits)
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    _, _, vocab, _ = mlx_loading._load_gguf(a.tokenizer_gguf or embedded_default_path())
    write_tokenizer(out, vocab, a.vocab)
    if a.draft_pair:  # the first N layers, the embeddings, the final norm and the head
        draft = Path(a.draft_pair)
        draft.mkdir(parents=True, exist_ok=True)
        model.model.layers = model.model.layers[: a.draft_layers]
        model.args.num_hidden_layers = a.draft_layers
        save_model(draft, model)
        save_config({**config, "num_hidden_layers": a.draft_layers}, draft / "config.json")
        write_tokenizer(draft, vocab, a.vocab)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--from-gguf", nargs="?", const="embedded", default=None)
    ap.add_argument(
        "--tokenizer-gguf",
        default=None,
        help="take the tokenizer from this GGUF (default: the embedded SmolLM2; on a machine "
        "without it, e.g. tests/modelgen/make_draft_model.py's small copy of its vocabulary)",
    )
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-pair", default=None, help="also write a draft model that agrees with this one here")
    ap.add_argument("--draft-layers", type=int, default=2, help="layers of the draft (--draft-pair)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if a.from_gguf:
        from_gguf(out, embedded_default_path() if a.from_gguf == "embedded" else a.from_gguf, a.bits, a.group)
    else:
        if a.vocab < 49152:
            raise SystemExit("--vocab must be at least 49152 (the SmolLM2 tokenizer the folder gets)")
        random_llama(out, a)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(json.dumps({"out": str(out), "bytes": size, "seconds": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main()
