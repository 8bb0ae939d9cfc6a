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

MODEL_NOT_FOUND = -31001
CONTEXT_OVERFLOW = -31002
LOAD_FAILED = -31003
QUEUE_FULL = -31004
BACKEND_UNAVAILABLE = -31005
NOT_SUPPORTED = -31006


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
