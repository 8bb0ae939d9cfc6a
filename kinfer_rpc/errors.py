"""Error codes: JSON-RPC's, LSP's, and kinfer's own.

kinfer's codes live in -31999..-31000, outside the ranges JSON-RPC (-32768..-32000) and LSP
(-32899..-32800 inside it) reserve. spec/specification.md documents each one.
"""

from typing import Any

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_NOT_INITIALIZED = -32002
REQUEST_CANCELLED = -32800
# The server went away before it answered: the clients' own code, and what `kinfer-rpc --attach`
# answers for the requests the daemon never did when it goes away.
SERVER_GONE = -32099

MODEL_NOT_FOUND = -31001
CONTEXT_OVERFLOW = -31002
LOAD_FAILED = -31003
QUEUE_FULL = -31004
BACKEND_UNAVAILABLE = -31005
NOT_SUPPORTED = -31006
RESPONSE_TOO_LARGE = -31007


class KinferError(Exception):
    """An error that reaches the client as a JSON-RPC error object with a documented code."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


def invalid_params(message: str, data: Any = None) -> KinferError:
    return KinferError(INVALID_PARAMS, message, data)


def model_not_found(name: str, available: list[str]) -> KinferError:
    listing = ", ".join(available) if available else "none"
    return KinferError(
        MODEL_NOT_FOUND,
        f"model {name!r} not found; available: {listing}",
        {"model": name, "available": available},
    )


def clip_echoes(error: dict[str, Any], limit: int = 1024) -> dict[str, Any]:
    """An error object whose message and data strings are at most `limit` characters: an error
    repeats what it refuses (a model name, a method), and a 50 MB name must not make a 50 MB
    answer. A cancelled request's data is its partial result, sent whole."""
    if error.get("code") == REQUEST_CANCELLED:
        return error
    return {k: _clip(v, limit) for k, v in error.items()}


def _clip(value: Any, limit: int, depth: int = 0) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + f"... ({len(value) - limit} more characters)"
    if depth < 8 and isinstance(value, dict):
        return {k: _clip(v, limit, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, list):
        return [_clip(v, limit, depth + 1) for v in value]
    return value
