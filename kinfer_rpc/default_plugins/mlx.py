"""The `mlx` backend: MLX with mlx-lm's model code (pinned in pyproject.toml).

Reads MLX model folders (config.json + safetensors, as mlx-lm writes them), Ollama's safetensors
models (their manifest) and GGUF files: `mx.load` keeps Q4_0/Q4_1/Q8_0 tensors quantized (group
32), their names are mapped onto mlx-lm's llama model, and the tokenizer is rebuilt from the
GGUF's own vocabulary and merges. llama.cpp stores Q and K rows in the interleaved order its rope
reads, so GGUF models run with the traditional (interleaved) rope layout instead of un-permuting.

KV cells live in one buffer per layer, (slots, kv heads, cells, head dim), each slot's tokens at
their own positions. A pass groups the step's chunks: every decode chunk (one token, or a token
and its drafts) goes into ONE batched forward, a row per sequence with its own positions and mask;
each prompt chunk is its own forward over its slot. Everything of a step is one graph, evaluated
once with mx.async_eval; the engine's wait is the only host read. The decode forward is
mx.compile'd per shape (_step_fn); greedy rows end in an argmax on the device (device_greedy), and
a pass of only greedy one-token rows queues the next pass fed with its own argmax (_build_ahead).

Weights (LoadOptions.weights): "quantized" runs them as stored; "dense" expands them at load
(float16 on a GPU, float32 on the CPU). Default: dense when that takes at most half the device's
free memory (_weights_form).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

import kinfer_rpc
from kinfer_rpc.types import LoadOptions, MachineInfo, ModelInfo, SeqChunk

log = logging.getLogger("kinfer_rpc.mlx")

try:
    # mlx_lm.utils imports transformers (about a second): it is imported when a model loads,
    # so the server still answers `initialize` at once; here only whether it is installed.
    import importlib.util

    import mlx.core as mx
    import mlx.nn as nn
    from tokenizers import Tokenizer

    if importlib.util.find_spec("mlx_lm") is None:
        raise ImportError("mlx-lm is not installed")
except Exception as exc:  # noqa: BLE001 - no MLX here: the server runs with the other backends
    mx = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = None

STEP = 256  # KV buffers grow by this many cells, and a batched pass reads keys in these blocks
# Drafts per step when a load names no count, by device and weight form, from the measured cost of
# a pass over k+1 positions of one sequence (bench/mlx_bench.py --mode curve; pick_drafts at 70%
# acceptance), fixed for the life of a load:
# - CUDA, dense float16 (the H200, MLX 0.32.4, 7.4B): 1 row 7.06 ms, 2-16 rows 1.15-1.25x: 13.
# - CUDA, 4-bit: 2-7 rows run as matrix-vector passes (5 rows 2.82x), 8-16 rows about 1.95x: 14.
# - CPU (SmolLM2, 2 cores): 2 rows 1.49x, 3 rows 1.44x, then about +0.4x a row: 2.
DEFAULT_DRAFTS = {("gpu", "dense"): 13, ("gpu", "quantized"): 14, ("cpu", "dense"): 2, ("cpu", "quantized"): 2}
# Texts llama.cpp also treats as end of generation when they are control tokens.
_EOG_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
    "<end_of_utterance>",
    # fill-in-the-middle pad and repo tokens end a generation in llama.cpp too
    "<|fim_pad|>",
    "<fim-pad>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
}
# llama.cpp pre-tokenizer names -> the regexes it splits with before byte-level BPE.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = {
    "smollm": ["digits", _GPT2],
    "starcoder": ["digits", _GPT2],
    "refact": ["digits", _GPT2],
    "gpt2": [_GPT2],
    "default": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
}
# GGUF tensor names -> mlx-lm's llama module paths.
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Architectures whose Model.__call__ is exactly `head(model.model(x))`: the head then runs only on
# the rows that asked for logits (not on every prompt token).
_SPLIT_HEAD = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "granite"}


# -- tokens ------------------------------------------------------------------------------------
def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token uses -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Vocab:
    """Tokenizer, token bytes, end-of-generation set and chat template of one model.

    Two `tokenizers` instances: one splits special tokens out of the text (parse_special), the
    other reads their text as text. Both are only read after construction, so any thread may use
    them.
    """

    def __init__(
        self,
        spec: dict,
        pieces: list[bytes],
        *,
        bos: int | None,
        eos: list[int],
        add_bos: bool,
        add_eos: bool,
        template: str | None,
        manual_specials: bool,
    ):
        self.spec = spec
        self.parse = Tokenizer.from_str(json.dumps(spec))
        self.plain = Tokenizer.from_str(json.dumps(spec))
        self.plain.encode_special_tokens = True
        self.pieces = pieces
        self.bos, self.add_bos, self.add_eos = bos, add_bos, add_eos
        self.eos = eos
        self.template = template
        self.manual_specials = manual_specials  # GGUF: BOS/EOS added here, not by a post-processor
        specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.eog = frozenset(eos) | {
            i for i in specials if i < len(pieces) and pieces[i].decode("utf-8", "replace") in _EOG_TEXTS
        }

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tok = self.parse if parse_special else self.plain
        ids = tok.encode(text, add_special_tokens=add_special and not self.manual_specials).ids
        if add_special and self.manual_specials:
            if self.add_bos and self.bos is not None:
                ids = [self.bos, *ids]
            if self.add_eos and self.eos:
                ids = [*ids, self.eos[0]]
        return ids

    @classmethod
    def from_gguf(cls, meta: dict) -> Vocab:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"the mlx backend reads GGUF tokenizers of the byte-level BPE kind (gpt2), not {model!r};"
                " load this model with the llama backend"
            )
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE:
            raise ValueError(
                f"the GGUF pre-tokenizer {pre!r} is not known to the mlx backend"
                f" (known: {', '.join(sorted(_PRE))}); load this model with the llama backend"
            )
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = _ints(meta.get("tokenizer.ggml.token_type"), [1] * len(tokens))
        merges = list(meta.get("tokenizer.ggml.merges", []))
        # Control (3) tokens are split out only when specials are parsed; user-defined (4) ones
        # always are (llama.cpp does the same).
        added = [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": ty == 3,
            }
            for i, (t, ty) in enumerate(zip(tokens, types))
            if ty in (3, 4)
        ]
        splits = []
        for part in _PRE[pre]:
            splits.append(
                {"type": "Digits", "individual_digits": True}
                if part == "digits"
                else {"type": "Split", "pattern": {"Regex": part}, "behavior": "Isolated", "invert": False}
            )
        spec = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    *splits,
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
                ],
            },
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {t: i for i, t in enumerate(tokens)},
                "merges": merges,
            },
        }
        dec = _byte_decoder()
        pieces = [t.encode() if ty in (3, 4) else bytes(dec.get(c, 0) for c in t) for t, ty in zip(tokens, types)]
        eos = [
            x
            for x in (
                _int(meta.get("tokenizer.ggml.eos_token_id")),
                _int(meta.get("tokenizer.ggml.eot_token_id")),
                _int(meta.get("tokenizer.ggml.eom_token_id")),
            )
            if x is not None
        ]
        return cls(
            spec,
            pieces,
            bos=_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos=eos,
            add_bos=bool(_int(meta.get("tokenizer.ggml.add_bos_token")) or 0),
            add_eos=bool(_int(meta.get("tokenizer.ggml.add_eos_token")) or 0),
            template=meta.get("tokenizer.chat_template"),
            manual_specials=True,
        )

    @classmethod
    def from_files(cls, files: dict[str, bytes], config: dict) -> Vocab:
        """From a Hugging Face tokenizer.json (+ tokenizer_config.json, generation_config.json)."""
        if "tokenizer.json" not in files:
            raise ValueError("the model has no tokenizer.json (the mlx backend reads only fast tokenizers)")
        spec = json.loads(files["tokenizer.json"])
        tconf = json.loads(files.get("tokenizer_config.json") or "{}")
        gconf = json.loads(files.get("generation_config.json") or "{}")
        vocab = dict(spec["model"]["vocab"])
        for t in spec.get("added_tokens", []):
            vocab[t["content"]] = t["id"]
        n = max(vocab.values()) + 1
        added = {t["id"] for t in spec.get("added_tokens", [])}
        dec = json.dumps(spec.get("decoder") or {})
        byte_level = '"ByteLevel"' in dec
        inv = _byte_decoder()
        pieces = [b""] * n
        for text, i in vocab.items():
            if i in added:
                pieces[i] = text.encode()
            elif byte_level:
                pieces[i] = bytes(inv.get(c, 0) for c in text)
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):  # byte fallback
                pieces[i] = bytes([int(text[3:5], 16)])
            else:
                pieces[i] = text.replace("\u2581", " ").encode()
        eos = []
        for src in (config.get("eos_token_id"), gconf.get("eos_token_id")):
            eos.extend(x for x in (src if isinstance(src, list) else [src]) if isinstance(x, int))
        eos_text = _token_text(tconf.get("eos_token"))
        if eos_text in vocab:
            eos.append(vocab[eos_text])
        template = tconf.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template = files.get("chat_template.jinja", b"").decode() or template
        bos_text = _token_text(tconf.get("bos_token"))
        vocab_obj = cls(
            spec,
            pieces,
            bos=vocab.get(bos_text) if bos_text else None,
            eos=list(dict.fromkeys(eos)),
            add_bos=False,
            add_eos=False,
            template=template,
            manual_specials=False,
        )
        probe = vocab_obj.parse.encode("a", add_special_tokens=True).ids
        vocab_obj.add_bos = bool(probe) and vocab_obj.bos is not None and probe[0] == vocab_obj.bos
        return vocab_obj


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _int(value) -> int | None:
    if value is None:
        return None
    try:
        return int(np.asarray(value).item())
    except (TypeError, ValueError):
        return None


def _ints(value, default: list) -> list:
    return default if value is None else np.asarray(value).astype(int).tolist()


# -- weights -----------------------------------------------------------------------------------
def _build(config: dict, weights: dict):
    """An mlx-lm model from its config and weights, quantized where the weights are."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)

    def quantized(path, module):
        w, s = weights.get(f"{path}.weight"), weights.get(f"{path}.scales")
        if s is None or w is None or not hasattr(module, "to_quantized"):
            return False
        group = config.get("quantization", {}).get("group_size", 32)
        bits = w.shape[-1] * 32 // (s.shape[-1] * group)
        return {"group_size": group, "bits": bits}

    nn.quantize(model, class_predicate=quantized)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _float_type(model, dtype) -> None:
    """Every float parameter in `dtype`: float16 on a GPU; float32 on the CPU, where MLX's float16
    and bfloat16 kernels are emulated (a quantized matmul with float16 scales is 40x slower)."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    mx.eval(model.parameters())


def _quantized(model) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def _dense_bytes(model, on_gpu: bool) -> int:
    """Bytes the weights take expanded to the float type (float16 on a GPU, float32 on the CPU)."""
    per = 2 if on_gpu else 4
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            total += m.scales.size * m.group_size * per + sum(
                v.nbytes for k, v in m.parameters().items() if k not in ("weight", "scales", "biases")
            )
        elif not m.children():
            total += sum(v.size * per for v in _leaves(m.parameters()))
    return total


def _leaves(tree):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


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


def _weights_form(model, wanted: str | None, on_gpu: bool) -> tuple[str, str]:
    """ "dense" or "quantized", and why. A model stored without quantized weights is dense
    whatever was asked. The default (`wanted` None): dense when the expanded weights (float16 on
    a GPU, float32 on the CPU) take at most half the device's free memory (what is left holds the
    KV cells and the passes), quantized otherwise or when the free memory is unknown. On a GPU
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
    where = "the GPU's" if on_gpu else "host memory's"
    need, free = _dense_bytes(model, on_gpu), _gpu_free() if on_gpu else (MachineInfo.host_available() or None)
    if free is None:
        return "quantized", f"{where} free memory is unknown"
    gib, kind = 1 << 30, "float16" if on_gpu else "float32"
    if need <= free // 2:
        return "dense", f"dense {kind} takes {need / gib:.2f} GiB, at most half {where} {free / gib:.1f} GiB free"
    return "quantized", f"dense {kind} would take {need / gib:.2f} GiB, over half {where} {free / gib:.1f} GiB free"


def _load_gguf(path: str):
    weights, meta = mx.load(path, return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"the mlx backend maps GGUF files of the llama architecture only, not {arch!r};"
            " load this model with the llama backend"
        )

    def num(key, default=None):
        v = meta.get(f"llama.{key}")
        return default if v is None else np.asarray(v).item()

    heads = int(num("attention.head_count"))
    hidden = int(num("embedding_length"))
    mapped = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[0] == "blk":
            base = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}"
            suffix = parts[3]
        elif parts[0] in _GGUF_NAMES:
            base, suffix = _GGUF_NAMES[parts[0]], parts[1]
        else:
            continue  # rope_freqs and the like: computed by mlx-lm's rope
        mapped[f"{base}.{suffix}"] = w
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(num("block_count")),
        "intermediate_size": int(num("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num("attention.head_count_kv", heads)),
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(num("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "head_dim": int(num("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(num("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in mapped,
        "quantization": {"group_size": 32},
    }
    return _build(config, mapped), config, Vocab.from_gguf(meta), meta


def _files(folder: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
    return {n: (folder / n).read_bytes() for n in names if (folder / n).is_file()}


def _load_folder(path: str):
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path))
    return model, config, Vocab.from_files(_files(Path(path)), config)


def _load_ollama(manifest: str):
    """An Ollama safetensors model: json layers hold config.json and the tokenizer files, each
    tensor layer a safetensors blob of one tensor (or a packed group, names inside the blob)."""
    doc = json.loads(Path(manifest).read_bytes())
    blobs = Path(manifest).parents[4] / "blobs"  # <models>/manifests/<host>/<namespace>/<model>/<tag>
    files, weights = {}, {}
    for layer in doc["layers"]:
        blob = blobs / layer["digest"].replace(":", "-")
        media = layer.get("mediaType", "")
        if media.startswith("application/vnd.ollama.image.json"):
            files[layer.get("name", "")] = blob.read_bytes()
        elif media.startswith("application/vnd.ollama.image.tensor"):
            inner = mx.load(str(blob), format="safetensors")
            if list(inner) == ["weight"] or len(inner) == 1 and layer.get("name"):
                inner = {layer["name"]: next(iter(inner.values()))}
            weights.update(inner)
    if "config.json" not in files:
        raise ValueError(f"{manifest}: no config.json layer")
    config = json.loads(files["config.json"])
    return _build(config, weights), config, Vocab.from_files(files, config)


# -- KV cells ----------------------------------------------------------------------------------
class _Cells:
    """Every slot's KV cells: per layer one key and one value buffer (slots, heads, cells, dim)."""

    def __init__(self, slots: int, layers: int):
        self.slots = slots
        self.keys: list = [None] * layers
        self.values: list = [None] * layers
        self.cap = 0
        self.want = 0  # cells the pass being built needs
        self.length = [0] * slots  # tokens each slot holds (positions 0..length-1)

    def reserve(self, cells: int) -> None:
        self.want = max(self.want, -(-cells // STEP) * STEP)

    def _ensure(self, layer: int, k, v) -> None:
        if self.keys[layer] is None:
            B, H, _, D = k.shape
            shape = (self.slots, H, self.want, D)
            self.keys[layer] = mx.zeros(shape, k.dtype)
            self.values[layer] = mx.zeros((*shape[:3], v.shape[-1]), v.dtype)
        elif self.keys[layer].shape[2] < self.want:
            grow = self.want - self.keys[layer].shape[2]
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys[layer] = mx.pad(self.keys[layer], pad)
            self.values[layer] = mx.pad(self.values[layer], pad)
        self.cap = max(self.cap, self.keys[layer].shape[2])

    def arrays(self) -> list:
        return [a for a in self.keys + self.values if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class _Rows:
    """The cache one layer sees in a batched pass: row b holds L tokens of slot slots[b] at
    positions pos[b].. ; it attends to its own slot's cells up to each token's position."""

    def __init__(self, cells: _Cells, layer: int, slots, cols, offset, mask, span: int, first: int | None):
        self.cells, self.layer = cells, layer
        self.slots, self.cols, self.offset, self.mask, self.span = slots, cols, offset, mask, span
        self.first = first

    def update_and_fetch(self, k, v):
        c, i = self.cells, self.layer
        c._ensure(i, k, v)
        c.keys[i][self.slots[:, None], :, self.cols] = k.transpose(0, 2, 1, 3)
        c.values[i][self.slots[:, None], :, self.cols] = v.transpose(0, 2, 1, 3)
        if self.first is not None:  # rows are the slots first.. in order: a view, not a gathered copy
            rows = slice(self.first, self.first + k.shape[0])
            return c.keys[i][rows, :, : self.span], c.values[i][rows, :, : self.span]
        return c.keys[i][self.slots, :, : self.span], c.values[i][self.slots, :, : self.span]

    def make_mask(self, N, return_array=False, window_size=None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the mlx backend yet")
        return self.mask


class _Traced:
    """The cache one layer sees in a compiled decode pass: the same reads and writes as _Rows, on
    the layer's buffers passed in (and returned) as arrays, positions and mask built on the device
    from `cols`, so that a step hands the graph only small index arrays."""

    def __init__(
        self,
        keys: list,
        values: list,
        layer: int,
        slots,
        cols,
        pos,
        mask,
        span: int,
        first,
        kernel: int = 0,
        counter=None,
    ):
        self.keys, self.values, self.layer = keys, values, layer
        self.slots, self.cols, self.offset, self.mask, self.span, self.first = slots, cols, pos, mask, span, first
        # On CUDA (kernel: thread blocks a row, see MlxModel.kernel): the attention is
        # kinfer_mlx_attention's, which also writes the pass's cells into the buffers in place
        # (counter: its scratch). Otherwise every write on CUDA would be a scatter (MLX 0.32
        # CUDA's slice_update at a device-side start copies the whole buffer: 17 ms a pass for
        # 64 buffers of 128 slots, measured).
        self.kernel, self.counter = kernel, counter

    def update_and_fetch(self, k, v):
        if self.kernel:  # the attention kernel writes and reads them (see scaled_dot_product_attention)
            return k, v
        i, B = self.layer, k.shape[0]
        K, V = self.keys[i], self.values[i]
        if B == 1:  # one sequence: its L cells are one block at (slot, 0, pos, 0)
            at = mx.concatenate([self.slots, mx.zeros((1,), mx.int32), self.offset, mx.zeros((1,), mx.int32)])
            K = mx.slice_update(K, k, at, (0, 1, 2, 3))
            V = mx.slice_update(V, v, at, (0, 1, 2, 3))
        else:
            K[self.slots[:, None], :, self.cols] = k.transpose(0, 2, 1, 3)
            V[self.slots[:, None], :, self.cols] = v.transpose(0, 2, 1, 3)
        self.keys[i], self.values[i] = K, V
        if self.first is not None:  # rows are consecutive slots: a slice at a device-side start
            return (
                mx.slice(K, self.first, (0,), (B, K.shape[1], self.span, K.shape[3])),
                mx.slice(V, self.first, (0,), (B, V.shape[1], self.span, V.shape[3])),
            )
        return K[self.slots, :, : self.span], V[self.slots, :, : self.span]

    def make_mask(self, N, return_array=False, window_size=None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the mlx backend yet")
        return self.mask


# -- decode attention on CUDA ------------------------------------------------------------------
def _attention_kernel(model, config: dict) -> bool:
    """Route the decode passes' attention of `model` to kinfer_mlx_attention's kernel (CUDA only;
    KINFER_MLX_ATTENTION=0 keeps MLX's masked attention, for comparison), once the kernel has
    passed its check against MLX's operations here. False when the kernel cannot run here, fails
    the check, or the model's attention cannot be routed (_route_attention)."""
    from kinfer_rpc.default_plugins import mlx_attention

    if os.environ.get("KINFER_MLX_ATTENTION", "1") == "0" or not mlx_attention.available():
        return False
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // max(heads, 1)))
    if not heads or heads % kv or head_dim % 32:
        return False
    try:  # the kernel against plain MLX operations once per load (it is MLX's JIT that builds it)
        dtype = next(
            (v.dtype for _, v in _flat(model.parameters()) if v.dtype in (mx.float16, mx.bfloat16, mx.float32)),
            mx.float16,
        )
        diff = mlx_attention.self_check(dtype, head_dim, heads // kv)
    except Exception as exc:  # noqa: BLE001 - a CUDA build without NVRTC headers, say: MLX's attention
        log.warning("mlx: the decode attention kernel did not run (%s); using MLX's attention", exc)
        return False
    if not diff < (0.05 if dtype == mx.bfloat16 else 0.02):
        log.warning("mlx: the decode attention kernel differs from MLX's by %s; using MLX's attention", diff)
        return False
    return _route_attention(model)


def _route_attention(model) -> bool:
    """mlx-lm's attention layers call their module's `scaled_dot_product_attention` (mlx_lm.models.
    base's); that name is wrapped in the module of the model's attention layer, so that a layer
    whose cache is a _Traced with the kernel on calls the kernel (with the layer's new cells, which
    it writes into the buffers), and every other call (mlx-lm's own caches, prompt passes) goes on
    to the original. False when the attention layer is not found, does not call such a function,
    or uses attention sinks."""
    import sys

    from kinfer_rpc.default_plugins import mlx_attention

    layers = getattr(model, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    if attn is None or hasattr(attn, "sinks"):
        return False
    module = sys.modules.get(type(attn).__module__)
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        return False
    original = getattr(original, "kinfer_original", original)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, _Traced) and cache.kernel:
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported by the decode attention kernel")
            i = cache.layer
            return mlx_attention.attention(
                queries,
                keys,
                values,
                cache.keys[i],
                cache.values[i],
                cache.slots,
                cache.cols,
                scale,
                cache.counter,
                splits=cache.kernel,
            )
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.kinfer_original = original
    module.scaled_dot_product_attention = scaled_dot_product_attention
    return True


# -- the loaded model --------------------------------------------------------------------------
class MlxModel:
    """A model loaded into MLX (the LoadedModel contract)."""

    def __init__(self, path: str, options: LoadOptions, progress: Callable[[float], None]):
        if options.host_tensors:
            raise NotImplementedError("keeping tensors in host memory is not supported by the mlx backend")
        if options.kv_type not in (None, "f16"):
            raise ValueError(
                f"the mlx backend keeps KV cells in the model's float type; kvType {options.kv_type!r} is not supported"
            )
        on_gpu = options.gpu_layers != 0 and mx.default_device() == mx.gpu
        self.device = mx.gpu if on_gpu else mx.cpu
        progress(0.0)
        p = Path(path)
        with mx.stream(self.device):
            if p.is_dir():
                self.model, self.config, self.vocab = _load_folder(path)
            elif p.is_file() and _is_gguf(p):
                self.model, self.config, self.vocab, _ = _load_gguf(path)
            elif p.is_file():
                self.model, self.config, self.vocab = _load_ollama(path)
            else:
                raise FileNotFoundError(f"no model at {path}")
            if not on_gpu or p.is_file() and _is_gguf(p):
                _float_type(self.model, mx.float16 if on_gpu else mx.float32)
            self.weights, self.weights_reason = _weights_form(self.model, options.weights, on_gpu)
            if self.weights == "dense" and _quantized(self.model):
                from mlx_lm.utils import dequantize_model

                self.model = dequantize_model(self.model)
                _float_type(self.model, mx.float16 if on_gpu else mx.float32)
                mx.clear_cache()
        progress(0.9)
        self.layers = len(self.model.layers)
        self.split_head = self.config.get("model_type") in _SPLIT_HEAD and hasattr(self.model, "model")
        self.cells = _Cells(options.slots, self.layers)
        self._compiled: dict = {}  # (slots consecutive, span) -> the compiled decode step
        self._greedy: set[int] = set()  # slots whose rows are sampled (argmax) in the pass
        self._sampled: tuple = (None, [])  # the last pass's token ids (device) and greedy rows
        self._ahead = None  # the next pass, queued (see _build_ahead)
        self.context = options.context_length
        drafts = (
            options.drafts if options.drafts is not None else DEFAULT_DRAFTS["gpu" if on_gpu else "cpu", self.weights]
        )
        self.drafts = drafts
        # With the attention kernel: the thread blocks a row (chunks of cells), enough for the
        # context length, and the kernel's counter; 0: MLX's attention.
        self.kernel, self.counter = 0, None
        if on_gpu and self.split_head and _attention_kernel(self.model, self.config):
            self._use_kernel()
        self.n_vocab = int(self.config.get("vocab_size") or len(self.vocab.pieces))
        flat = dict(_flat(self.model.parameters()))
        group = (self.config.get("quantization") or {}).get("group_size", 32)
        params = sum(
            flat[f"{k[:-7]}.scales"].size * group if f"{k[:-7]}.scales" in flat else v.size
            for k, v in flat.items()
            if not k.endswith((".scales", ".biases"))
        )
        size = sum(v.nbytes for v in flat.values())
        v = self.vocab
        self.info = ModelInfo(
            name=p.name,
            path=path,
            backend="mlx",
            n_vocab=self.n_vocab,
            context_length=options.context_length,
            slots=options.slots,
            architecture=str(self.config.get("model_type", "")),
            parameters=int(params),
            size_bytes=int(size),
            context_train=int(self.config.get("max_position_embeddings") or 0),
            description=f"{self.config.get('model_type', '')} on MLX {mx.__version__} ({'gpu' if on_gpu else 'cpu'})",
            bos_text=v.pieces[v.bos].decode("utf-8", "replace") if v.bos is not None else "",
            eos_text=v.pieces[v.eos[0]].decode("utf-8", "replace") if v.eos else "",
            add_bos=v.add_bos,
            drafts=drafts,
            weights=self.weights,
        )
        log.info("mlx: %s weights (%s)", self.weights, self.weights_reason)
        progress(1.0)

    def _use_kernel(self) -> None:
        """Decode passes from now on through kinfer_mlx_attention's kernel (once it is routed)."""
        from kinfer_rpc.default_plugins import mlx_attention

        self.kernel = -(-self.context // mlx_attention.CHUNK)
        heads = int(self.config.get("num_attention_heads") or 1)
        self.counter = mx.zeros((self.cells.slots * heads * (self.drafts + 1),), dtype=mx.int32)
        mx.eval(self.counter)

    # -- tokens -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.pieces[token] if 0 <= token < len(self.vocab.pieces) else b""

    def eog_tokens(self):
        return self.vocab.eog

    def chat_template(self) -> str | None:
        return self.vocab.template

    # -- decoding ---------------------------------------------------------------------------
    def _logits(self, inputs, cache, rows=None):
        """Logits of the forward over `inputs`; only `rows` (flat indices) when given."""
        if self.split_head:
            h = self.model.model(inputs, cache)
            h = h.reshape(-1, h.shape[-1])
            if rows is not None:
                h = h[rows]
            m = self.model
            return m.lm_head(h) if hasattr(m, "lm_head") else m.model.embed_tokens.as_linear(h)
        out = self.model(inputs, cache=cache)
        out = out.reshape(-1, out.shape[-1])
        return out if rows is None else out[rows]

    def _groups(self, chunks: Sequence[SeqChunk]) -> list[list[SeqChunk]]:
        """Chunks that share one forward: every decode chunk (a token, or a token and its drafts)
        in one; prompt chunks together while padding them to the longest wastes under a quarter.
        Each group is one weight read; every chunk, alone or not, takes the same path."""
        short = sorted((c for c in chunks if len(c.tokens) <= self.drafts + 1), key=lambda c: c.seq)
        groups = [short] if short else []
        group, tokens = [], 0
        for c in sorted((c for c in chunks if len(c.tokens) > self.drafts + 1), key=lambda c: -len(c.tokens)):
            if group and len(group[0].tokens) * (len(group) + 1) * 4 > (tokens + len(c.tokens)) * 5:
                groups.append(group)
                group, tokens = [], 0
            group.append(c)
            tokens += len(c.tokens)
        groups += [group] if group else []
        return [sorted(g, key=lambda c: c.seq) for g in groups]

    def _step_fn(self, consecutive: bool, span: int):
        """A decode pass as a function of arrays only (for mx.compile): tokens (B, L), slots (B,),
        cols (B, L), pos (B,), the flat rows that want logits, and every layer's buffers; returns
        the logits and the updated buffers."""
        layers = self.layers

        def step(tokens, slots, cols, pos, rows, keys, values):
            keys, values = list(keys), list(values)
            mask = None if self.kernel else (mx.arange(span, dtype=mx.int32)[None, None] <= cols[:, :, None])[:, None]
            first = slots[:1] if consecutive else None
            cache = [
                _Traced(keys, values, i, slots, cols, pos, mask, span, first, self.kernel, self.counter)
                for i in range(layers)
            ]
            logits = self._logits(tokens, cache, rows)
            if self.kernel:
                # The kernel wrote the cells into the buffers in place, which MLX does not see:
                # the buffers handed on depend on the pass (every layer's kernel is upstream of
                # the logits), so that whatever reads them next (the next pass, a prompt's
                # scatter, a copy) runs after it, and evaluating them runs the pass.
                bufs = mx.depends(keys + values, [logits])
                keys, values = bufs[:layers], bufs[layers:]
            return logits, keys, values

        return step

    def _buffers_ready(self) -> bool:
        """Every layer's buffers hold the cells the pass being built needs (a compiled pass
        cannot grow them)."""
        want = self.cells.want
        return all(k is not None and k.shape[2] >= want for k in self.cells.keys)

    def _compiled_step(self, seqs: list[int], last: int):
        """The compiled decode pass for rows of slots `seqs` whose last position is `last`: its
        trace replayed, not rebuilt op by op in Python, one per (slots consecutive or not, span)
        shape. The span is the cells a pass reads: up to `last` in blocks of STEP, or with the
        attention kernel the buffers' whole (it reads them in place; no retrace every STEP cells)."""
        cells = self.cells
        consecutive = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        span = cells.want if self.kernel else min(cells.want, -(-(last + 1) // STEP) * STEP)
        fn = self._compiled.get((consecutive, span))
        if fn is None:
            fn = self._compiled[(consecutive, span)] = mx.compile(self._step_fn(consecutive, span))
        return fn

    def _forward(self, group: Sequence[SeqChunk]):
        """One forward over a group (row b: chunk b, padded to the longest); the logits of the
        rows that asked for them, in the group's order, or None."""
        cells = self.cells
        B, L = len(group), max(len(c.tokens) for c in group)
        pos = np.array([c.pos for c in group], dtype=np.int32)
        tokens = np.zeros((B, L), dtype=np.int32)
        want = []
        for b, c in enumerate(group):
            tokens[b, : len(c.tokens)] = c.tokens
            want.extend(range(b * L + len(c.tokens) - c.outputs, b * L + len(c.tokens)))
        cols = pos[:, None] + np.arange(L, dtype=np.int32)[None]
        cells.reserve(int(cols.max()) + 1)
        seqs = [c.seq for c in group]
        if L <= self.drafts + 1 and self._buffers_ready():
            fn = self._compiled_step(seqs, int(cols.max()))
            want_a = mx.array(np.array(want or [0], dtype=np.int32))
            seq_a = mx.array(seqs, dtype=mx.int32)
            out, cells.keys, cells.values = fn(
                mx.array(tokens), seq_a, mx.array(cols), mx.array(pos), want_a, cells.keys, cells.values
            )
            return out if want else None
        span = min(cells.want, -(-int(cols.max() + 1) // STEP) * STEP)
        first = seqs[0] if seqs == list(range(seqs[0], seqs[0] + B)) else None
        # Row b's token i (at cols[b, i]) sees its own slot's cells up to its own position.
        mask = (np.arange(span, dtype=np.int32)[None, None] <= cols[:, :, None])[:, None]
        args = (mx.array(seqs, dtype=mx.int32), mx.array(cols), mx.array(pos), mx.array(mask), span, first)
        cache = [_Rows(cells, i, *args) for i in range(self.layers)]
        rows = mx.array(np.array(want or [0], dtype=np.int32))
        out = self._logits(mx.array(tokens), cache, rows)
        return out if want else None

    def decode(self, chunks: Sequence[SeqChunk]):
        cells = self.cells
        for c in chunks:
            if c.pos != cells.length[c.seq]:
                raise ValueError(f"sequence {c.seq} holds {cells.length[c.seq]} cells; a chunk at {c.pos} leaves a gap")
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._ahead_matches(ahead, chunks):
            return self._take_ahead(ahead, chunks)
        pieces, starts, n_out = [], {}, 0
        with mx.stream(self.device):
            out = None
            for group in self._groups(chunks):
                out = self._forward(group)
                if out is not None:
                    pieces.append(out)
                for c in group:
                    starts[id(c)] = n_out
                    n_out += c.outputs
            for c in chunks:
                cells.length[c.seq] = c.pos + len(c.tokens)
            result = ids = None
            greedy = [c.seq in self._greedy for c in chunks for _ in range(c.outputs)]
            host = [i for i, g in enumerate(greedy) if not g]  # rows whose logits come back
            if n_out:
                index = [starts[id(c)] + i for c in chunks for i in range(c.outputs)]
                result = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
                if index != list(range(n_out)):
                    result = result[mx.array(index)]
                if any(greedy):  # the argmax in the step's graph: only token ids come back
                    ids = mx.argmax(result, axis=1)
                    result = result[mx.array(host)].astype(mx.float32) if host else None
                else:
                    result = result.astype(mx.float32)
            # One evaluation for the whole step. When the last forward gives logits, every write
            # of the step is upstream of them (each layer's attention reads its written cells,
            # each group's writes go on from the group before): the outputs alone are named, as
            # mlx-lm does (naming 64 buffers too costs host time on every step). Otherwise the
            # cells are named.
            named = [a for a in (result, ids) if a is not None]
            mx.async_eval(*named, *(cells.arrays() if out is None or not named else ()))
            if ids is not None and all(greedy):
                self._build_ahead(chunks, ids)
        n_vocab = self.n_vocab
        self._sampled = (ids, greedy)

        def logits() -> np.ndarray:
            if ids is not None:  # rows sampled here stay zeros; the others' logits in place
                out = np.zeros((n_out, n_vocab), dtype=np.float32)
                if result is not None:
                    out[host] = np.asarray(result)
                else:
                    mx.synchronize()
                return out
            if result is None:
                mx.synchronize()
                return np.zeros((0, n_vocab), dtype=np.float32)
            return np.asarray(result)

        return logits

    # -- greedy rows sampled on the device (the LoadedModel's optional contract) ---------------
    device_greedy = True
    decode_async = True  # mx.async_eval: decode() returns while the pass runs

    def set_device_greedy(self, seq: int, on: bool) -> bool:
        """From the next pass on, the output rows of `seq` end in an argmax in the pass's graph."""
        (self._greedy.add if on else self._greedy.discard)(seq)
        self._ahead = None
        return True

    # A pass whose every row is one greedy token of a sequence (no prompt, no drafts) queues the
    # next pass at once, fed with its own argmax on the device (what mlx-lm's generate_step does):
    # the device computes it while the engine handles this pass's tokens. The engine's next
    # decode takes it when it asks for exactly those tokens at those positions (greedy: it does,
    # unless a request ended or joined); otherwise it is dropped. A dropped pass wrote each
    # sequence's cell after its last one, which the engine's next pass over that position
    # overwrites before anything reads it.
    def _build_ahead(self, chunks: Sequence[SeqChunk], ids) -> None:
        cells = self.cells
        if any(len(c.tokens) != 1 or c.outputs != 1 for c in chunks):
            return
        order = sorted(range(len(chunks)), key=lambda b: chunks[b].seq)
        seqs = [chunks[b].seq for b in order]
        pos = np.array([chunks[b].pos + 1 for b in order], dtype=np.int32)
        if int(pos.max()) + 1 >= self.context or int(pos.max()) + 1 > cells.want:
            return
        if not self._buffers_ready():
            return
        B = len(seqs)
        fn = self._compiled_step(seqs, int(pos.max()))
        tokens = ids[mx.array(order)].reshape(B, 1).astype(mx.int32)
        out, cells.keys, cells.values = fn(
            tokens,
            mx.array(seqs, dtype=mx.int32),
            mx.array(pos[:, None]),
            mx.array(pos),
            mx.arange(B, dtype=mx.int32),
            cells.keys,
            cells.values,
        )
        nxt = mx.argmax(out, axis=1)
        if order != list(range(B)):
            nxt = nxt[mx.array(np.argsort(order))]
        mx.async_eval(nxt)  # every layer's written cells are upstream of it
        self._ahead = ([(c.seq, c.pos + 1) for c in chunks], ids, nxt)

    def _ahead_matches(self, ahead, chunks: Sequence[SeqChunk]) -> bool:
        where, ids, _ = ahead
        if [(c.seq, c.pos) for c in chunks] != where or any(len(c.tokens) != 1 or c.outputs != 1 for c in chunks):
            return False
        return [c.tokens[0] for c in chunks] == np.asarray(ids).tolist()

    def _take_ahead(self, ahead, chunks: Sequence[SeqChunk]):
        _, _, ids = ahead
        for c in chunks:
            self.cells.length[c.seq] = c.pos + 1
        with mx.stream(self.device):
            self._build_ahead(chunks, ids)
        n, n_vocab = len(chunks), self.n_vocab
        self._sampled = (ids, [True] * n)

        def logits() -> np.ndarray:
            np.asarray(ids)
            return np.zeros((n, n_vocab), dtype=np.float32)

        return logits

    def sampled_tokens(self) -> list[int]:
        """After a pass's wait: the token of every output row sampled here, -1 for the others."""
        ids, greedy = self._sampled
        if ids is None:
            return [-1] * len(greedy)
        return [t if g else -1 for t, g in zip(np.asarray(ids).tolist(), greedy)]

    def seq_remove(self, seq: int, start: int = 0, end: int = -1) -> None:
        self._ahead = None
        held = self.cells.length[seq]
        if 0 <= end < held and start < end:
            raise NotImplementedError("the mlx backend removes cells from a position to the end only")
        self.cells.length[seq] = min(held, max(0, start))

    def seq_copy(self, src: int, dst: int, start: int = 0, end: int = -1) -> None:
        self._ahead = None
        if start != 0:
            raise NotImplementedError("the mlx backend copies a sequence's cells from position 0 only")
        c = self.cells
        n = c.length[src] if end < 0 else min(end, c.length[src])
        with mx.stream(self.device):
            for i in range(self.layers):
                if c.keys[i] is not None:
                    c.keys[i][dst] = c.keys[i][src]
                    c.values[i][dst] = c.values[i][src]
        c.length[dst] = n

    def memory(self) -> dict:
        return {
            "modelBytes": self.info.size_bytes,
            "contextCells": self.cells.slots * self.context,
            "kvBytes": self.cells.nbytes(),
            "kvType": "f16",
            "device": "gpu" if self.device == mx.gpu else "cpu",
        }

    def close(self) -> None:
        self.model = None
        self.cells = _Cells(self.cells.slots, 0)
        mx.clear_cache()


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def step_cost_curve(model: MlxModel, k_max: int = 16, repeats: int = 3, context: int = 64) -> list[float]:
    """Seconds a pass over one sequence's k+1 positions takes, k = 0..k_max (for the draft count)."""
    costs = []
    prompt = list(range(1, context + 1))
    model.seq_remove(0)
    model.decode([SeqChunk(0, 0, prompt, 1)])()
    for k in range(k_max + 1):
        best = float("inf")
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model.decode([SeqChunk(0, context, [1] * (k + 1), k + 1)])()
            best = min(best, time.perf_counter() - t)
            model.seq_remove(0, context, -1)
        costs.append(best)
    return costs


def pick_drafts(costs: list[float], acceptance: float = 0.7) -> int:
    """The draft count that gives the most expected tokens per second of pass, at an acceptance
    rate typical of edits (each draft accepted with `acceptance` given the ones before it)."""

    def gain(k):
        return sum(acceptance**i for i in range(k + 1)) / costs[k]

    return max(range(len(costs)), key=gain)


class MlxBackend:
    """MLX with mlx-lm's models: reads MLX folders, Ollama safetensors models and GGUF."""

    name = "mlx"
    formats = ("mlx", "gguf")
    weights = ("quantized", "dense")

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> MlxModel:
        return MlxModel(path, options, progress)


@kinfer_rpc.hookimpl
def register_backends(register):
    if _IMPORT_ERROR is not None:
        log.warning("the mlx backend is not available: %s", _IMPORT_ERROR)
        return
    register(MlxBackend())
