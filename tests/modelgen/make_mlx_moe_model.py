"""Write a small random-weight mixture-of-experts MLX folder (config.json, model.safetensors,
tokenizer files) for each MoE family mlx-lm ships that the mlx backend is tested with.

    python tests/modelgen/make_mlx_moe_model.py OUT --family qwen3_moe [--bits 4 --group 32]
    python tests/modelgen/make_mlx_moe_model.py OUT --shape 30b-a3b --layers 16 --bits 4 --group 64

Families (FAMILIES): qwen3_moe, qwen2_moe (with its shared expert), mixtral, deepseek_v2 (greedy
routing) and deepseek_v3 (grouped sigmoid routing), both with latent attention, yarn rope and a
first dense layer. Each is a few layers of hidden size 64 with 8 experts, 2 a token. Weights: mlx-lm's model
built from the config, every parameter drawn again (mlx-lm initialises some routers and biases
to zeros, which would send every token to the same experts), saved in float16 as mlx-lm saves a
model, or quantized by mlx_lm.utils.quantize_model (affine, `bits`, `group`). The output head is
drawn wider than the rest so that a greedy reply rarely meets a near-tie. The tokenizer is
SmolLM2's (make_mlx_model.write_tokenizer), vocabulary 49152.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

from kinfer_rpc.default_plugins.mlx import loading as mlx_loading
from kinfer_rpc.host.store import embedded_default_path

VOCAB = 49152

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

_DEEPSEEK: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
}

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "intermediate_size": 96,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "rope_theta": 1000000.0,
    },
    "qwen2_moe": {
        "intermediate_size": 96,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "rope_theta": 1000000.0,
    },
    "mixtral": {
        "intermediate_size": 48,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
    },
    "deepseek_v2": {**_DEEPSEEK, "topk_method": "greedy", "routed_scaling_factor": 1.0},
    "deepseek_v3": {
        **_DEEPSEEK,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
    },
}


# Layer shapes of released MoE models, for measuring (the tests use the small FAMILIES shapes):
# --shape NAME overrides the family's sizes, --layers how many of its layers are written.
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, 8 a token.
    "30b-a3b": {
        "family": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
}


def config_of(family: str, shape: str | None = None, layers: int | None = None) -> dict[str, Any]:
    config = {"model_type": family, **_COMMON, **FAMILIES[family]}
    if shape:
        sizes = dict(SHAPES[shape])
        if sizes.pop("family") != family:
            raise SystemExit(f"shape {shape} is a {SHAPES[shape]['family']} model, not {family}")
        config.update(sizes)
    if layers:
        config["num_hidden_layers"] = layers
    return config


def random_model(
    family: str, seed: int = 0, shape: str | None = None, layers: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's model of `family` with every parameter drawn from `seed`: matrices normal with
    variance 1/fan-in (the output head 1.5 a weight, so that logits spread wide), norm weights
    near 1, routers' correction biases small."""
    config = config_of(family, shape, layers)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    key = mx.random.key(seed)
    drawn = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.fold_in(key, i) if hasattr(mx.random, "fold_in") else mx.random.key(seed * 100003 + i)
        if name.endswith("lm_head.weight"):
            w = 1.5 * mx.random.normal(p.shape, key=k)
        elif p.ndim >= 2:
            w = mx.random.normal(p.shape, key=k) * (p.shape[-1] ** -0.5)
        elif "norm" in name:
            w = 1.0 + 0.1 * mx.random.normal(p.shape, key=k)
        else:  # biases, the routers' score corrections
            w = 0.05 * mx.random.normal(p.shape, key=k)
        drawn.append((name, w.astype(mx.float16)))
        if len(drawn) % 64 == 0:  # a large shape: draw in pieces, not one graph of every parameter
            model.update(tree_unflatten(drawn))
            mx.eval(model.parameters())
            drawn = []
    model.update(tree_unflatten(drawn))
    mx.eval(model.parameters())
    return model, config


def write(
    out: Path,
    family: str,
    bits: int | None = None,
    group: int = 32,
    seed: int = 0,
    shape: str | None = None,
    layers: int | None = None,
    tokenizer_gguf: str | None = None,
) -> Path:
    """The folder of `family`'s random model at `out` (made), quantized when `bits` is given."""
    from make_mlx_model import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    model, config = random_model(family, seed, shape, layers)
    if bits:
        model, config = quantize_model(model, config, group_size=group, bits=bits)
        mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    _, _, vocab, _ = mlx_loading._load_gguf(tokenizer_gguf or embedded_default_path())
    write_tokenizer(out, vocab, config["vocab_size"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    ap.add_argument("--bits", type=int, default=None)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a released model's layer shapes")
    ap.add_argument("--layers", type=int, default=None, help="write this many layers")
    ap.add_argument(
        "--tokenizer-gguf",
        default=None,
        help="take SmolLM2's tokenizer from this GGUF (default: the embedded one; elsewhere "
        "tests/modelgen/make_draft_model.py's small copy of its vocabulary)",
    )
    a = ap.parse_args()
    t = time.perf_counter()
    out = write(Path(a.out), a.family, a.bits, a.group, a.seed, a.shape, a.layers, a.tokenizer_gguf)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(json.dumps({"out": str(out), "bytes": size, "seconds": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main()
