"""Python clients: spawn `kinfer-rpc`, do the lifecycle, and offer generate/chat/infill.

Blocking, and an iterator of streamed pieces:

    from kinfer_rpc.client import Client

    with Client() as kinfer:
        print(kinfer.chat([{"role": "user", "content": "Hi"}], maxTokens=50).text)
        for piece in kinfer.stream_chat([{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)

Async (anyio: asyncio or trio):

    from kinfer_rpc.client import AsyncClient

    async with AsyncClient() as kinfer:
        result = await kinfer.chat([{"role": "user", "content": "Hi"}], maxTokens=50)
        async for piece in kinfer.stream_chat([{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)

Breaking out of a stream, closing it, cancelling the task that awaits a call (an anyio cancel
scope, a timeout) or Ctrl-C in a blocking call sends `$/cancelRequest`; the server stops the work
and answers -32800. The server runs in a session of its own, so a terminal's Ctrl-C reaches the
script alone: catch KeyboardInterrupt around a stream and the same server takes the next request.

Options are the protocol's camelCase ones (`maxTokens`, `temperature`, `seed`, `stop`,
`ignoreEos`, `logprobs`, `topLogprobs`, `grammar`, `regex`, ...), sent as given. `format` takes a
JSON schema (a dict), "json", or a class with a `model_json_schema()` classmethod (a pydantic
model), whose schema is sent. `close()`, leaving the `with` block, and garbage collection
of a `Client` shut the server down cleanly (`shutdown`, `exit`, exit code 0, the process reaped).

Errors: an error response raises the RpcError subclass of its code, one per documented code
(`ModelNotFound`, `ContextOverflow`, `InvalidParams`, `RequestCancelled` alias `Cancelled`, ...;
`ERRORS` maps code to class), and `ServerGone` (-32099) when the server exited before it answered.
Each keeps `code`, `message` and `data`:

    try:
        kinfer.chat(messages, model="no-such-model")
    except ModelNotFound as e:
        e.data["available"]

Agents: `chat(messages, tools=[...], tool_choice=...)` offers tools (OpenAI's shape); the
Result's `tool_calls` are the calls the model made (`stop_reason` "toolCalls"):

    reply = kinfer.chat(messages, tools=[weather_tool])
    messages.append(reply.message)                       # the assistant's turn, with its calls
    for call in reply.tool_calls:
        messages.append(call.answer(get_weather(**call.arguments)))   # a "tool" message

Code completion: `infill(prefix, suffix, extra=[...])` fills the gap between the text before and
after the cursor (a model with fill-in-the-middle tokens; else InvalidParams, -32602), with other files
as context; the Result's `dropped` says how much of a long prefix, suffix or extra context did not
fit. `stopAtLine=True` completes one line:

    done = kinfer.infill("def add(a, b):\n    return ", "\n", stopAtLine=True, maxTokens=32)
    done.text, done.dropped.prefix

Thinking models (Qwen3, DeepSeek-R1...): `chat(messages, think=True)` (or False, or "low",
"medium", "high") and `maxReasoningTokens=N`; the Result's `reasoning` is apart from its `text`,
and a stream's reasoning pieces are `Thought`s (a str):

    for piece in kinfer.stream_chat(messages, think=True):
        print(("(" + piece + ")") if isinstance(piece, Thought) else piece, end="")
"""

from __future__ import annotations

from kinfer_rpc.client.aio import AsyncClient, AsyncStream
from kinfer_rpc.client.errors import (
    ERRORS,
    SERVER_GONE,
    BackendUnavailable,
    Cancelled,
    ContextOverflow,
    InternalError,
    InvalidParams,
    InvalidRequest,
    LoadFailed,
    MethodNotFound,
    ModelNotFound,
    NotSupported,
    ParseError,
    QueueFull,
    RequestCancelled,
    ResponseTooLarge,
    RpcError,
    ServerGone,
    ServerNotInitialized,
)
from kinfer_rpc.client.results import (
    Dropped,
    Embeddings,
    IgnoredParameter,
    LayerDevice,
    LoadedModel,
    Model,
    ModelStatus,
    Progress,
    Ranked,
    Ranking,
    Reproducibility,
    Result,
    Thought,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
)
from kinfer_rpc.client.sync import Client, Stream
from kinfer_rpc.client.wire import REQUEST_CANCELLED, server_command

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "BackendUnavailable",
    "Cancelled",
    "Client",
    "ContextOverflow",
    "Dropped",
    "ERRORS",
    "Embeddings",
    "IgnoredParameter",
    "InternalError",
    "InvalidParams",
    "InvalidRequest",
    "LayerDevice",
    "LoadFailed",
    "LoadedModel",
    "MethodNotFound",
    "Model",
    "ModelNotFound",
    "ModelStatus",
    "NotSupported",
    "ParseError",
    "Progress",
    "QueueFull",
    "REQUEST_CANCELLED",
    "Ranked",
    "Ranking",
    "Reproducibility",
    "RequestCancelled",
    "ResponseTooLarge",
    "Result",
    "RpcError",
    "SERVER_GONE",
    "ServerGone",
    "ServerNotInitialized",
    "Stream",
    "Thought",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "Usage",
    "server_command",
]
