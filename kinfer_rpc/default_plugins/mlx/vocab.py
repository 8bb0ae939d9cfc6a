"""The mlx backend's tokenizer: a model's vocabulary, token bytes, end-of-generation set and chat
template. From a GGUF, the tokenizer is rebuilt from the file's own vocabulary and merges (byte-level
BPE, split first with llama.cpp's pre-tokenizer regexes); from a Hugging Face model, read from its
tokenizer.json.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from tokenizers import Tokenizer

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


def _byte_decoder() -> dict[str, int]:
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
        spec: dict[str, Any],
        pieces: list[bytes],
        *,
        bos: int | None,
        eos: list[int],
        add_bos: bool,
        add_eos: bool,
        template: str | None,
        manual_specials: bool,
    ) -> None:
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
    def from_gguf(cls, meta: dict[str, Any]) -> Vocab:
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
        splits: list[dict[str, Any]] = []
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
    def from_files(cls, files: dict[str, bytes], config: dict[str, Any]) -> Vocab:
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
        eos: list[int] = []
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


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(np.asarray(value).item())
    except (TypeError, ValueError):
        return None


def _ints(value: Any, default: list[int]) -> list[int]:
    if value is None:
        return default
    ints: list[int] = np.asarray(value).astype(int).tolist()
    return ints
