"""Reading models into mlx-lm's model code, for the mlx backend.

Reads MLX model folders (config.json + safetensors, as mlx-lm writes them), Ollama's safetensors
models (their manifest) and GGUF files of the llama (Mixtral's too: llama with experts), qwen2,
qwen3, qwen3moe and qwen2moe architectures: `mx.load` reads F32/F16/BF16 tensors and keeps
Q4_0/Q4_1/Q8_0 ones quantized (group 32); a tensor of any other type (the K-quants, IQ types...)
is refused before any weight is read, by name and type. The tensors' names are mapped onto
mlx-lm's model of the architecture (a mixture of experts' stacked ffn_*_exps onto its SwitchGLU), and
the tokenizer is rebuilt from the GGUF's own vocabulary and merges (vocab.py). For llama,
llama.cpp's converter stores Q and K rows in the interleaved order its rope reads, so llama GGUFs
run with the traditional (interleaved) rope layout instead of un-permuting; the qwen families are
stored unpermuted.

Weights (LoadOptions.weights): "quantized" runs them as stored; "dense" expands them at load
(float16 on a GPU, float32 on the CPU). Default: dense when that takes at most half the device's
free memory (_weights_form).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

# From the module that defines them: mlx.nn has these names from mlx.nn.layers, which imports them
# without re-exporting them (no __all__, no `as`), so a strict type check does not see them in mlx.nn
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear, quantize

from kinfer_rpc import errors
from kinfer_rpc.default_plugins.mlx import gguf_header
from kinfer_rpc.default_plugins.mlx.vocab import Vocab
from kinfer_rpc.types import MachineInfo

if TYPE_CHECKING:
    from mlx.nn.layers.base import Module

# GGUF tensor names -> mlx-lm's module paths (llama's, and the qwen2/qwen3 families' extras: per-head
# Q/K norms, the router and stacked experts of a mixture of experts, qwen2_moe's shared expert).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Mixtral's router and experts live under block_sparse_moe in mlx-lm's model.
_MIXTRAL_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
}
# GGUF architectures -> mlx-lm model types (a llama file with experts is Mixtral: llama.cpp's
# converter writes Mixtral as llama). llama.cpp's converter permutes Q/K rows into the
# interleaved rope layout for llama only; the qwen families keep the halves (NeoX) layout that
# mlx-lm's own models use.
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# ggml tensor types mx.load reads: floats (BF16 read as float16) and the 32-weight block types it
# keeps quantized (affine, group 32).
_GGUF_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


def _build(config: dict[str, Any], weights: dict[str, mx.array]) -> Any:
    """An mlx-lm model from its config and weights, quantized where the weights are."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)

    def quantized(path: str, module: Module) -> bool | dict[str, Any]:
        # A layer the config names has its own group size and bits (mlx-lm's quantize_model keeps
        # a mixture of experts' router at 8 bits, group 64, beside 4-bit layers); the others'
        # come from the shapes stored: the module's (unquantized) input width over the scales'
        # and the packed weight's.
        own = (config.get("quantization") or {}).get(path)
        if isinstance(own, (dict, bool)):
            return own
        w, s = weights.get(f"{path}.weight"), weights.get(f"{path}.scales")
        if s is None or w is None or not hasattr(module, "to_quantized"):
            return False
        width = _parameters(module)["weight"].shape[-1]
        return {"group_size": width // s.shape[-1], "bits": w.shape[-1] * 32 // width}

    quantize(model, class_predicate=quantized)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _float_type(model: Any, dtype: mx.Dtype) -> None:
    """Every float parameter in `dtype`: float16 on a GPU; float32 on the CPU, where MLX's float16
    and bfloat16 kernels are emulated (a quantized matmul with float16 scales is 40x slower)."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    mx.eval(model.parameters())


def _quantized(model: Any) -> bool:
    return any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for _, m in model.named_modules())


def _dense_bytes(model: Any, on_gpu: bool) -> int:
    """Bytes the weights take expanded to the float type (float16 on a GPU, float32 on the CPU)."""
    per = 2 if on_gpu else 4
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            total += m.scales.size * m.group_size * per + sum(
                v.nbytes for k, v in _parameters(m).items() if k not in ("weight", "scales", "biases")
            )
        elif not m.children():
            total += sum(v.size * per for v in _leaves(m.parameters()))
    return total


def _parameters(module: Any) -> dict[str, Any]:
    """module.parameters(), of a module taken as Any: mlx.nn's Module.parameters is unannotated."""
    params: dict[str, Any] = module.parameters()
    return params


def _leaves(tree: Any) -> list[Any]:
    return [v for _, v in _flat(tree)]


def _gpu_free() -> int | None:
    """Free memory of the GPU MLX runs on, or None when MLX cannot say: CUDA reports free_memory;
    Metal (unified memory) the recommended working set, less what MLX holds."""
    try:
        info = mx.device_info(mx.gpu) if hasattr(mx, "device_info") else mx.metal.device_info()
    except Exception:  # noqa: BLE001 - an MLX without the query
        return None
    if "free_memory" in info:
        return int(info["free_memory"])
    total = info.get("max_recommended_working_set_size") or info.get("memory_size") or info.get("total_memory")
    return int(total) - mx.get_active_memory() if total else None


def _weights_form(model: Any, wanted: str | None, on_gpu: bool, rows: bool = False) -> tuple[str, str]:
    """ "dense" or "quantized", and why. A model stored without quantized weights is dense
    whatever was asked. The default (`wanted` None): on a GPU whose decode passes run kinfer's
    row-invariant matmul (`rows`), quantized: there a pass reads quantized weights faster than
    dense ones at every row count (docs/performance.md). Otherwise dense when the expanded
    weights (float16 on a GPU, float32 on the CPU) take at most half the device's free memory
    (what is left holds the KV cells and the passes), quantized otherwise or when the free
    memory is unknown. With MLX's own kernels on a GPU
    dense float16 is MLX's fast path for many rows (MLX 0.32 CUDA's quantized matmul plateaus near
    300 tok/s on a 7B); on the CPU dense float32 (BLAS) beats MLX's quantized matmul too
    (SmolLM2: 9.3 vs 7.1 tok/s alone, 12.0 vs 9.3 at 8), and like it gives a row the same result
    whatever rows are beside it."""
    if wanted not in (None, "quantized", "dense"):
        raise ValueError(f"weights must be 'quantized' or 'dense', not {wanted!r}")
    if not _quantized(model):
        return "dense", "the model stores no quantized weights"
    if wanted is not None:
        return wanted, "set by the load options"
    if on_gpu and rows:
        return "quantized", "kinfer's row-invariant matmul reads quantized weights faster than dense ones"
    where = "the GPU's" if on_gpu else "host memory's"
    need, free = _dense_bytes(model, on_gpu), _gpu_free() if on_gpu else (MachineInfo.host_available() or None)
    if free is None:
        return "quantized", f"{where} free memory is unknown"
    gib, kind = 1 << 30, "float16" if on_gpu else "float32"
    if need <= free // 2:
        return "dense", f"dense {kind} takes {need / gib:.2f} GiB, at most half {where} {free / gib:.1f} GiB free"
    return "quantized", f"dense {kind} would take {need / gib:.2f} GiB, over half {where} {free / gib:.1f} GiB free"


def _gguf_checked(path: str) -> None:
    """The GGUF's header, read before any weight: its architecture must be one mapped here and
    every tensor of a type mx.load reads (it fails on others with no tensor named)."""
    architecture, tensors = gguf_header.read(path)
    if architecture not in _GGUF_ARCHS:
        raise ValueError(
            f"the mlx backend maps GGUF files of the {', '.join(_GGUF_ARCHS)} architectures,"
            f" not {architecture!r}; load this model with the llama backend"
        )
    for name, ttype in tensors:
        if ttype not in _GGUF_TYPES:
            kind = gguf_header.TYPE_NAMES.get(ttype, f"type {ttype}")
            raise ValueError(
                f"GGUF tensor {name} is {kind}: the mlx backend reads GGUF tensors of the types"
                f" {', '.join(_GGUF_TYPES.values())} only; load this model with the llama backend"
            )


def _load_gguf(path: str) -> tuple[Any, dict[str, Any], Vocab, dict[str, Any]]:
    _gguf_checked(path)
    loaded = mx.load(path, return_metadata=True)
    assert isinstance(loaded, tuple)  # with return_metadata: (arrays, metadata)
    weights, meta = loaded
    arch = str(meta.get("general.architecture"))
    model_type = _GGUF_ARCHS[arch]
    pooling = meta.get(f"{arch}.pooling_type")
    if pooling is not None and int(np.asarray(pooling).item()) != 0:  # an embedding model or reranker
        raise errors.KinferError(
            errors.NOT_SUPPORTED,
            "this GGUF is an embedding model (it declares a pooling): it runs on the llama backend, and on the mlx "
            "backend as an MLX folder with its sentence-transformers pooling",
        )

    def num(key: str, default: float | None = None) -> Any:  # a number of the GGUF's metadata, or default
        v = meta.get(f"{arch}.{key}")
        return default if v is None else np.asarray(v).item()

    mixtral = arch == "llama" and int(num("expert_count", 0)) > 0
    if mixtral:
        model_type = "mixtral"
        # mlx-lm's mixtral takes a head's width as hidden / heads and needs the experts a token uses
        heads, hidden = int(num("attention.head_count")), int(num("embedding_length"))
        if int(num("attention.key_length", hidden // heads)) * heads != hidden or num("expert_used_count") is None:
            raise ValueError(
                "this llama GGUF with experts is not laid out as Mixtral (a head's width hidden / heads,"
                " an expert_used_count); load this model with the llama backend"
            )
    names = _GGUF_NAMES | _MIXTRAL_NAMES if mixtral else _GGUF_NAMES

    heads = int(num("attention.head_count"))
    hidden = int(num("embedding_length"))
    mapped: dict[str, mx.array] = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            base = f"model.layers.{parts[1]}.{names[parts[2]]}"
            suffix = parts[3]
        elif parts[0] in names and len(parts) == 2:
            base, suffix = names[parts[0]], parts[1]
        elif parts[0] == "rope_freqs":
            continue  # computed by mlx-lm's rope
        else:
            raise ValueError(
                f"GGUF tensor {name} has no place in mlx-lm's {model_type} model;"
                " load this model with the llama backend"
            )
        if parts[-2] == "ffn_gate_inp_shexp" and w.ndim == 1:
            w = w[None]  # llama.cpp keeps the shared expert's gate as a vector; mlx-lm as a 1-row Linear
        mapped[f"{base}.{suffix}"] = w
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(num("block_count")),
        "intermediate_size": int(num("feed_forward_length", num("expert_feed_forward_length", 0))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num("attention.head_count_kv", heads)),
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(num("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "rope_traditional": arch == "llama",
        "head_dim": int(num("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(num("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in mapped,
        "quantization": {"group_size": 32},
    }
    if arch in ("qwen3moe", "qwen2moe"):
        config |= {
            "num_experts": int(num("expert_count")),
            "num_experts_per_tok": int(num("expert_used_count")),
            "moe_intermediate_size": int(num("expert_feed_forward_length")),
            # llama.cpp runs every qwen3moe layer as a mixture, the chosen experts' weights
            # normalized to sum to one; qwen2moe's are the softmax's own
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": arch == "qwen3moe",
        }
    if mixtral:  # routing as llama.cpp runs it: softmax, the top experts, their weights renormalized
        config |= {
            "num_local_experts": int(num("expert_count")),
            "num_experts_per_tok": int(num("expert_used_count")),
            "intermediate_size": int(num("expert_feed_forward_length", num("feed_forward_length"))),
        }
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(num("expert_shared_feed_forward_length"))
    return _build(config, mapped), config, Vocab.from_gguf(meta), meta


def _files(folder: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
    return {n: (folder / n).read_bytes() for n in names if (folder / n).is_file()}


def _load_folder(path: str) -> tuple[Any, dict[str, Any], Vocab]:
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path))
    return model, config, Vocab.from_files(_files(Path(path)), config)


def _load_ollama(manifest: str) -> tuple[Any, dict[str, Any], Vocab]:
    """An Ollama safetensors model: json layers hold config.json and the tokenizer files, each
    tensor layer a safetensors blob of one tensor (or a packed group, names inside the blob)."""
    doc = json.loads(Path(manifest).read_bytes())
    blobs = Path(manifest).parents[4] / "blobs"  # <models>/manifests/<host>/<namespace>/<model>/<tag>
    files: dict[str, bytes] = {}
    weights: dict[str, mx.array] = {}
    for layer in doc["layers"]:
        blob = blobs / layer["digest"].replace(":", "-")
        media = layer.get("mediaType", "")
        if media.startswith("application/vnd.ollama.image.json"):
            files[layer.get("name", "")] = blob.read_bytes()
        elif media.startswith("application/vnd.ollama.image.tensor"):
            inner = mx.load(str(blob), format="safetensors")
            assert isinstance(inner, dict)  # safetensors: name -> array
            if list(inner) == ["weight"] or len(inner) == 1 and layer.get("name"):
                inner = {layer["name"]: next(iter(inner.values()))}
            weights.update(inner)
    if "config.json" not in files:
        raise ValueError(f"{manifest}: no config.json layer")
    config: dict[str, Any] = json.loads(files["config.json"])
    return _build(config, weights), config, Vocab.from_files(files, config)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def _flat(params: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    flat = tree_flatten(params)
    assert isinstance(flat, list)  # a dict only when given one to fill (`destination`)
    return flat
