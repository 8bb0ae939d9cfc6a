"""kinfer-rpc: a local LLM inference runtime spoken to over stdin/stdout (JSON-RPC 2.0, LSP framing)."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

from kinfer_rpc.hookspecs import hookimpl as hookimpl  # noqa: E402  (plugins write @kinfer_rpc.hookimpl)
