"""What a llama.cpp model's file and vocabulary say: metadata and tokens."""

from __future__ import annotations

import ctypes
from typing import Any


class LlamaVocab:
    """What a llama.cpp model's file and vocabulary say (metadata, tokens), for the backend's
    generating and embedding models alike: they set `L`, `model`, `vocab` and `_pieces`."""

    L: Any
    model: Any
    vocab: Any
    _pieces: dict[int, bytes]

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def _desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.L.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self.token_bytes(token).decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self.L.llama_token * cap)()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (self.L.llama_token * cap)()
            n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self.L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self.L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            piece = self._pieces[token] = buf.raw[:n]
        return piece
