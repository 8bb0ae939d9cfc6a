"""Copy SmolLM2-135M-Instruct's GGUF with fill-in-the-middle tokens.

    python tests/modelgen/make_fim_model.py OUT.gguf [--metadata] [--source SmolLM2.gguf]

or, from a test, `make_fim_model(dst_path)` (returns dst_path).

The default model has no fill-in-the-middle tokens: its special tokens 0-16 are <|endoftext|>,
<|im_start|>, <|im_end|>, <repo_name>, <reponame>, <file_sep>, <filename>, <gh_stars>, issue and
Jupyter markers, and llama.cpp finds only a repository token in it (4, <reponame>). So
`inference/infill` refuses it. The copy renames five of those special tokens (ids unchanged, still
control tokens) to StarCoder's and Qwen's spellings, which llama.cpp (and kinfer-rpc's own search of
the vocabulary) recognise:

    5 <|file_sep|>   8 <fim_prefix>   9 <fim_middle>   10 <fim_suffix>   11 <fim_pad>

With `metadata=True` it leaves the spellings alone and declares the same ids with the GGUF keys
tokenizer.ggml.fim_{pre,suf,mid,pad,sep}_token_id instead. The weights are SmolLM2's, which was not
trained to fill in the middle: its completions are deterministic but not good code. Every other key
and every tensor is copied as is (make_tool_model.copy_gguf).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

FIM_IDS = {"sep": 5, "pre": 8, "mid": 9, "suf": 10, "pad": 11}
SPELLINGS = {
    "sep": "<|file_sep|>",
    "pre": "<fim_prefix>",
    "mid": "<fim_middle>",
    "suf": "<fim_suffix>",
    "pad": "<fim_pad>",
}
TOKENS_KEY = "tokenizer.ggml.tokens"
TYPES_KEY = "tokenizer.ggml.token_type"
CONTROL = 3  # gguf.TokenType.CONTROL


def make_fim_model(dst_path: str | os.PathLike[str], source: str | None = None, metadata: bool = False) -> str:
    """Write the copy of `source` (default: the embedded SmolLM2 GGUF) with FIM tokens to
    `dst_path`; returns dst_path as a str."""
    from make_tool_model import copy_gguf

    def edit(name: str, value: Any) -> Any:
        if name == TOKENS_KEY and not metadata:
            value = list(value)
            for key, token in FIM_IDS.items():
                value[token] = SPELLINGS[key]
        if name == TYPES_KEY and not metadata:
            # SmolLM2's are control tokens already; a SentencePiece vocabulary's (the random-weight
            # shapes of make_model.py) are byte tokens, which must not carry another spelling
            value = list(value)
            for token in FIM_IDS.values():
                value[token] = CONTROL
        return value

    def add(w: Any) -> None:
        if metadata:
            for key, token in FIM_IDS.items():
                w.add_uint32(f"tokenizer.ggml.fim_{key}_token_id", token)

    return copy_gguf(dst_path, source, edit=edit, add=add)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--metadata", action="store_true", help="declare the ids in metadata, keep the spellings")
    ap.add_argument("--source", default=None, help="the GGUF to copy (default: the embedded SmolLM2)")
    args = ap.parse_args()
    make_fim_model(args.out, args.source, args.metadata)


if __name__ == "__main__":
    main()
