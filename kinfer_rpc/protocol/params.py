"""The protocol's own params: a chat's messages, a prompt's token ids. Option objects are read by
kinfer_rpc.host.options (Fields), which every handler uses for its params too."""

from __future__ import annotations

from typing import Any

from kinfer_rpc import errors
from kinfer_rpc.host.options import check_text


def messages(value: object) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise errors.invalid_params("messages must be a non-empty list of {role, content}")
    out: list[dict[str, str]] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise errors.invalid_params(f"messages[{i}] must be an object with string role and content")
        check_text(m["role"], f"messages[{i}].role")
        check_text(m["content"], f"messages[{i}].content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def tokens(value: Any, n_vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise errors.invalid_params("tokens must be a list of integers")
    bad = [t for t in value if not 0 <= t < n_vocab]
    if bad:
        raise errors.invalid_params(f"token ids out of the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
    return list(value)
