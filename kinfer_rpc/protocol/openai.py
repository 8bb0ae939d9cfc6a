"""OpenAI's API on kinfer's runtime: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/v1/embeddings` (kinfer_rpc.protocol.http serves them).

Requests become the host's typed requests (Chat, Generate, Infill, Embed) and replies the API's
shapes, streamed as server-sent events. What OpenAI's API asks that kinfer cannot do (several
choices, frequency or presence penalties, logit biases, images, echo) is a 400 naming the field.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import attrs
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kinfer_rpc import __version__, errors
from kinfer_rpc.host.embeddings import Embed
from kinfer_rpc.host.options import RequestOptions
from kinfer_rpc.host.requests import Chat, Generate, Infill, Logprob, Piece, Reply
from kinfer_rpc.protocol import params
from kinfer_rpc.protocol.web import ApiError, Flow, Owners, read_json, unsupported

T = TypeVar("T")

if TYPE_CHECKING:
    from kinfer_rpc.protocol.server import Service

FINISH = {"stop": "stop", "length": "length", "toolCalls": "tool_calls", "cancelled": "stop"}
FINGERPRINT = f"kinfer-{__version__}"

# kinfer's names for the fields its errors name -> OpenAI's
_FIELDS = {
    "options.maxTokens": "max_tokens",
    "options.temperature": "temperature",
    "options.topP": "top_p",
    "options.seed": "seed",
    "options.stop": "stop",
    "options.logprobs": "logprobs",
    "options.topLogprobs": "top_logprobs",
    "options.format": "response_format",
    "toolChoice": "tool_choice",
    "think": "reasoning_effort",
    "options.maxReasoningTokens": "thinking_token_budget",
    "params.prompt": "prompt",
    "params.tokens": "prompt",
    "params.input": "input",
    "params.suffix": "suffix",
    "dimensions": "dimensions",
}


def field_name(kinfer: str) -> str:
    """The OpenAI field a kinfer field name stands for."""
    for ours, theirs in _FIELDS.items():
        if kinfer == ours or kinfer.startswith(ours + "."):
            return theirs + kinfer[len(ours) :]
    return kinfer.removeprefix("params.").removeprefix("options.")


def error_body(exc: ApiError, streaming: bool) -> tuple[int, bytes]:
    """OpenAI's error shape; in a stream, as its last event."""
    body = {
        "error": {
            "message": exc.message,
            "type": "invalid_request_error" if exc.status < 500 else "server_error",
            "param": exc.field,
            "code": exc.code,
        }
    }
    data = json.dumps(body).encode()
    return exc.status, (b"data: " + data + b"\n\n" if streaming else data)


def _error_response(exc: ApiError) -> Response:
    status, body = error_body(exc, False)
    return Response(body, status_code=status, media_type="application/json")


def _checked(call: Callable[[], T]) -> T:
    """Run a parse; kinfer's -32602 becomes OpenAI's 400 naming OpenAI's field."""
    try:
        return call()
    except errors.KinferError as exc:
        raise ApiError.of(exc, field_name) from None


# -- requests ------------------------------------------------------------------------------------
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "seed",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "logprobs",
        "top_logprobs",
        "n",
        "user",
        "metadata",
        "store",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "service_tier",
        "ignore_eos",  # llama-server's and vLLM's extension: generate through end of generation
        "reasoning_effort",
        "thinking_token_budget",  # vLLM's: the most tokens the reasoning takes before its end is forced
        "chat_template_kwargs",  # vLLM's and llama-server's: here only {enable_thinking}
    }
)
COMPLETION_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "suffix",
        "stream",
        "stream_options",
        "seed",
        "stop",
        "max_tokens",
        "temperature",
        "top_p",
        "logprobs",
        "n",
        "user",
        "echo",
        "best_of",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "ignore_eos",
    }
)


def _refuse_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise unsupported(extra[0], "kinfer does not know this field")


def _refuse_common(body: dict[str, Any]) -> None:
    """The fields of both endpoints that kinfer cannot honour beyond their neutral value."""
    if body.get("n") not in (None, 1):
        raise unsupported("n", "one choice a request (send several requests: they run in one batch)")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise unsupported(name, "kinfer has a repeat penalty, not this one")
    if body.get("logit_bias"):
        raise unsupported("logit_bias")
    if body.get("store"):
        raise unsupported("store", "kinfer keeps no completions")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier")


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    return model or None


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", name)
    return value


def _stream_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise ApiError(400, "stream_options must be {include_usage?}", "stream_options")
    return _bool(opts, "include_usage")


def _options(body: dict[str, Any], *, max_tokens: int | None = None, constraint: Any = None) -> RequestOptions:
    """The sampling fields, checked as kinfer checks its own options."""
    given = {
        "max_tokens": body.get("max_completion_tokens", body.get("max_tokens", max_tokens)),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "seed": body.get("seed"),
        "stop": body.get("stop"),
        "ignore_eos": body.get("ignore_eos"),
        "constraint": constraint,
        "max_reasoning_tokens": body.get("thinking_token_budget"),
    }
    return _checked(lambda: RequestOptions(**{k: v for k, v in given.items() if v is not None}))


def _messages(value: object) -> list[dict[str, Any]]:
    """OpenAI's messages as kinfer's, then checked and shaped as kinfer's are."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{at} must be an object", at)
        if "function_call" in m:
            raise unsupported(f"{at}.function_call", "give tool_calls instead")
        role = m.get("role")
        content = m.get("content")
        images: list[str] = []
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("text", "input_text") and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "refusal" and isinstance(part.get("refusal"), str):
                    texts.append(part["refusal"])
                elif kind == "image_url":
                    images.append(_image_url(part.get("image_url"), f"{at}.content[{j}]"))
                else:
                    raise unsupported(
                        f"{at}.content[{j}]", f"a {kind or 'non-text'} part (kinfer reads text and images)"
                    )
            content = "".join(texts)
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if images:  # before the message's text, whatever their place among its parts
            message["images"] = images
        if m.get("reasoning_content") is not None:  # DeepSeek's, vLLM's and llama-server's name
            message["reasoning"] = m["reasoning_content"]
        if m.get("tool_calls"):
            message["toolCalls"] = m["tool_calls"]
        elif content is None and role == "assistant":
            message["content"] = ""
        if role == "tool":
            if m.get("tool_call_id") is not None:
                message["toolCallId"] = m["tool_call_id"]
            if m.get("name") is not None:
                message["name"] = m["name"]
        out.append(message)
    return _checked(lambda: params.messages(out, paths=False))


def _image_url(value: object, at: str) -> str:
    """An image_url part's image: a data: URL (kinfer fetches nothing from the network)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url.partition(",")[0] + ",":
        raise unsupported(f"{at}.image_url", "an image other than a base64 data: URL (kinfer fetches nothing)")
    return url


# reasoning_effort -> think: a level, or "none" (no reasoning)
EFFORTS: dict[str, bool | str] = {"none": False, "low": "low", "medium": "medium", "high": "high"}


def _think(body: dict[str, Any]) -> bool | str | None:
    """`reasoning_effort`, or vLLM's and llama-server's `chat_template_kwargs.enable_thinking`."""
    kwargs = body.get("chat_template_kwargs")
    switch = None
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
            raise unsupported("chat_template_kwargs", "kinfer sets the template's enable_thinking alone")
        switch = kwargs.get("enable_thinking")
        if switch is not None and not isinstance(switch, bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs")
    value = body.get("reasoning_effort")
    if value is None:
        return switch
    if not isinstance(value, str) or value not in EFFORTS:
        raise ApiError(400, 'reasoning_effort must be "none", "low", "medium" or "high"', "reasoning_effort")
    if switch is not None and switch != (EFFORTS[value] is not False):
        raise ApiError(400, "reasoning_effort and chat_template_kwargs.enable_thinking disagree", "reasoning_effort")
    return EFFORTS[value]


def _response_format(value: object) -> tuple[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("format", "json")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema", "response_format")
        return ("format", json.dumps(schema))
    raise ApiError(400, 'response_format.type must be "text", "json_object" or "json_schema"', "response_format")


@attrs.frozen
class ChatCall:
    chat: Chat
    stream: bool
    usage_chunk: bool
    logprobs: bool
    model: str


def chat_request(body: dict[str, Any]) -> ChatCall:
    _refuse_unknown(body, CHAT_FIELDS)
    _refuse_common(body)
    model = _model(body)
    messages = _messages(body.get("messages"))
    tool_list = _checked(lambda: params.tools(body.get("tools")))
    choice = _checked(lambda: params.tool_choice(body.get("tool_choice"), tool_list))
    logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    options = _options(body, constraint=_response_format(body.get("response_format")))
    options = _checked(lambda: attrs.evolve(options, logprobs=logprobs or None, top_logprobs=top))
    chat = Chat(
        tuple(messages),
        model,
        tuple(tool_list),
        choice,
        options,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        think=_think(body),
    )
    return ChatCall(chat, _bool(body, "stream"), _stream_usage(body), logprobs, model or "")


@attrs.frozen
class CompletionCall:
    request: Generate | Infill
    stream: bool
    usage_chunk: bool
    logprobs: bool
    model: str


def completion_request(body: dict[str, Any]) -> CompletionCall:
    _refuse_unknown(body, COMPLETION_FIELDS)
    _refuse_common(body)
    if body.get("echo"):
        raise unsupported("echo")
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "one choice a request")
    model = _model(body)
    prompt = body.get("prompt")
    tokens: tuple[int, ...] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens, prompt = tuple(prompt), None
    if not isinstance(prompt, str) and tokens is None:
        raise ApiError(400, "prompt must be a string, a list of one string or a list of token ids", "prompt")
    top = body.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5):
        raise ApiError(400, "logprobs must be an integer from 0 to 5", "logprobs")
    options = _options(body, max_tokens=16)  # OpenAI's default for completions
    if top is not None:
        options = _checked(lambda: attrs.evolve(options, logprobs=True, top_logprobs=top))
    suffix = body.get("suffix")
    request: Generate | Infill
    if suffix is not None:
        if not isinstance(suffix, str) or prompt is None:
            raise ApiError(400, "suffix must be a string, with a text prompt", "suffix")
        request = Infill(prompt, suffix, model, options=options)
    else:
        request = Generate(model, prompt, tokens, None, options)
    return CompletionCall(request, _bool(body, "stream"), _stream_usage(body), top is not None, model or "")


# -- replies -------------------------------------------------------------------------------------
def _logprob_entry(e: Logprob) -> dict[str, Any]:
    return {
        "token": e.text,
        "logprob": e.logprob,
        "bytes": list(e.text.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for _, t, lp in e.top],
    }


def _usage(reply: Reply) -> dict[str, Any]:
    u = reply.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for c in reply.tool_calls or ()
    ]


def chat_completion(reply: Reply, rid: str, created: int, logprobs: bool) -> dict[str, Any]:
    calls = _tool_calls(reply)
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if reply.text or not calls else None}
    if reply.reasoning is not None:  # as DeepSeek's API, vLLM and llama-server give it
        message["reasoning_content"] = reply.reasoning
    if calls:
        message["tool_calls"] = calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": reply.model,
        "system_fingerprint": FINGERPRINT,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": [_logprob_entry(e) for e in reply.logprobs or ()]} if logprobs else None,
                "finish_reason": FINISH.get(reply.stop_reason, "stop"),
            }
        ],
        "usage": _usage(reply),
    }


def text_completion(reply: Reply, rid: str, created: int, logprobs: bool) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": reply.model,
        "system_fingerprint": FINGERPRINT,
        "choices": [
            {
                "text": reply.text,
                "index": 0,
                "logprobs": _legacy_logprobs(reply.logprobs or ()) if logprobs else None,
                "finish_reason": FINISH.get(reply.stop_reason, "stop"),
            }
        ],
        "usage": _usage(reply),
    }


def _legacy_logprobs(entries: tuple[Logprob, ...]) -> dict[str, Any]:
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _event(value: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


class _Events:
    """Pieces of a reply as the stream's chunks."""

    streaming = True

    def __init__(
        self, emit: Callable[[bytes], Awaitable[None]], chunk: Callable[[Piece], bytes | dict[str, Any] | None]
    ):
        self._emit = emit
        self._chunk = chunk

    def started(self, partial: Callable[[], Reply]) -> None:
        pass

    async def piece(self, piece: Piece) -> None:
        chunk = self._chunk(piece)
        if chunk is not None:
            await self._emit(chunk if isinstance(chunk, bytes) else _event(chunk))


class _Template:
    """A stream's event for one string field, encoded once around a mark: each event then costs
    the string's own encoding (the rest of the chunk is the same for every piece). The bytes are
    exactly those of _event(make(text))."""

    _MARK = "\x00kinfer-mark\x00"

    def __init__(self, make: Callable[[str], dict[str, Any]]):
        head, _, tail = _event(make(self._MARK)).partition(json.dumps(self._MARK).encode())
        self._head, self._tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self._head + json.dumps(text).encode() + self._tail


# -- routes --------------------------------------------------------------------------------------
def routes(service: Service, owners: Owners) -> list[Route]:
    requests = service.handlers.requests

    async def guarded(run: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await run()
        except ApiError as exc:
            return _error_response(exc)
        except errors.KinferError as exc:
            return _error_response(ApiError.of(exc, field_name))

    async def chat_completions(request: Request) -> Response:
        async def parse() -> Response:
            call = chat_request(await read_json(request))
            owner = owners.of(request)
            rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
            if not call.stream:

                async def whole(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
                    reply = await requests.chat(call.chat, owner=owner)
                    return json.dumps(chat_completion(reply, rid, created, call.logprobs)).encode()

                return Flow(whole, media_type="application/json", error=error_body, fields=field_name)
            calling = bool(call.chat.tools) and call.chat.tool_choice.mode != "none"

            def base(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
                chunk: dict[str, Any] = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": call.model,
                    "system_fingerprint": FINGERPRINT,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                }
                if call.usage_chunk:
                    chunk["usage"] = None
                return chunk

            async def stream(send: Callable[[bytes], Awaitable[None]]) -> bytes:
                # The first chunk names the role; it goes out with the first content, so that an
                # error before any (an unknown model, say) is still answered with its status.
                opened: list[bool] = []

                async def emit(data: bytes) -> None:
                    if not opened:
                        opened.append(True)
                        await send(_event(base({"role": "assistant", "content": ""})))
                    await send(data)

                content = _Template(lambda text: base({"content": text}))

                def chunk(piece: Piece) -> bytes | dict[str, Any] | None:
                    # With tools on offer the reply's text may be call markup: its content and
                    # calls are sent once the reply is read whole (its reasoning as it comes).
                    if calling:
                        return base({"reasoning_content": piece.reasoning}) if piece.reasoning else None
                    if not piece.text and not piece.logprobs and not piece.reasoning:
                        return None
                    if not piece.reasoning and not call.logprobs:
                        return content(piece.text)  # the usual piece: text alone
                    lp = {"content": [_logprob_entry(e) for e in piece.logprobs or ()]} if call.logprobs else None
                    delta: dict[str, Any] = {"reasoning_content": piece.reasoning} if piece.reasoning else {}
                    if piece.text or not piece.reasoning:
                        delta["content"] = piece.text
                    return base(delta, logprobs=lp)

                reply = await requests.chat(call.chat, _Events(emit, chunk), owner=owner)
                if calling:
                    if reply.text:
                        await emit(_event(base({"content": reply.text})))
                    for i, c in enumerate(_tool_calls(reply)):
                        await emit(_event(base({"tool_calls": [{"index": i, **c}]})))
                await emit(_event(base({}, FINISH.get(reply.stop_reason, "stop"))))
                if call.usage_chunk:
                    usage = base({})
                    usage["choices"] = []
                    usage["usage"] = _usage(reply)
                    usage["model"] = reply.model
                    await emit(_event(usage))
                return b"data: [DONE]\n\n"

            return Flow(stream, media_type="text/event-stream", error=error_body, fields=field_name)

        return await guarded(parse)

    async def completions(request: Request) -> Response:
        async def parse() -> Response:
            call = completion_request(await read_json(request))
            owner = owners.of(request)
            rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

            async def run(req: Generate | Infill, sink: _Events | None) -> Reply:
                if isinstance(req, Infill):
                    return await requests.infill(req, sink, owner=owner)
                return await requests.generate(req, sink, owner=owner)

            if not call.stream:

                async def whole(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
                    reply = await run(call.request, None)
                    return json.dumps(text_completion(reply, rid, created, call.logprobs)).encode()

                return Flow(whole, media_type="application/json", error=error_body, fields=field_name)

            def base(text: str, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
                chunk: dict[str, Any] = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": call.model,
                    "system_fingerprint": FINGERPRINT,
                    "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
                }
                if call.usage_chunk:
                    chunk["usage"] = None
                return chunk

            async def stream(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
                text = _Template(lambda text: base(text))

                def chunk(piece: Piece) -> bytes | dict[str, Any] | None:
                    if not piece.text and not piece.logprobs:
                        return None
                    if not call.logprobs:
                        return text(piece.text)
                    lp = _legacy_logprobs(piece.logprobs or ()) if call.logprobs else None
                    return base(piece.text, logprobs=lp)

                reply = await run(call.request, _Events(emit, chunk))
                await emit(_event(base("", FINISH.get(reply.stop_reason, "stop"))))
                if call.usage_chunk:
                    usage = base("")
                    usage["choices"] = []
                    usage["usage"] = _usage(reply)
                    await emit(_event(usage))
                return b"data: [DONE]\n\n"

            return Flow(stream, media_type="text/event-stream", error=error_body, fields=field_name)

        return await guarded(parse)

    async def models(request: Request) -> Response:
        refs = await anyio.to_thread.run_sync(service.runtime.store.list)
        data = [{"id": r.name, "object": "model", "created": 0, "owned_by": r.source or "kinfer"} for r in refs]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        refs = await anyio.to_thread.run_sync(service.runtime.store.list)
        for r in refs:
            if r.name == name:
                return JSONResponse({"id": r.name, "object": "model", "created": 0, "owned_by": r.source or "kinfer"})
        return _error_response(ApiError(404, f"model {name!r} not found", "model", "model_not_found"))

    async def embeddings(request: Request) -> Response:
        async def parse() -> Response:
            body = await read_json(request)
            _refuse_unknown(body, frozenset({"model", "input", "encoding_format", "dimensions", "user"}))
            raw = body.get("input")
            if isinstance(raw, list) and raw and not all(isinstance(x, str) for x in raw):
                raise unsupported("input", "token ids as input (give the texts)")
            texts = _checked(lambda: params.texts(raw, "input"))
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise ApiError(400, 'encoding_format must be "float" or "base64"', "encoding_format")
            dims = body.get("dimensions")
            if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
                raise ApiError(400, "dimensions must be a positive integer", "dimensions")
            req = Embed(texts, _model(body), normalize=True, truncate=False, dimensions=dims)

            async def whole(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
                out = await requests.embed(req)
                data = []
                for i, row in enumerate(out.vectors):
                    vector: Any = (
                        base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode()
                        if fmt == "base64"
                        else [float(x) for x in row]
                    )
                    data.append({"object": "embedding", "index": i, "embedding": vector})
                usage = {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}
                return json.dumps({"object": "list", "data": data, "model": out.model, "usage": usage}).encode()

            return Flow(whole, media_type="application/json", error=error_body, fields=field_name)

        return await guarded(parse)

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ]
