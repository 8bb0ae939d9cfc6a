"""Ollama's API on kinfer's runtime: `/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`,
`/api/show`, `/api/ps`, `/api/pull`, `/api/version` (kinfer_rpc.protocol.http serves them).

Requests become the host's typed requests and replies Ollama's shapes, streamed as JSON lines
(Ollama streams unless `stream` is false). Ollama's `options` map onto kinfer's request options
(`num_predict`, `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`, `repeat_last_n`,
`seed`, `stop`) and `num_ctx` onto the load's context; an option kinfer cannot honour is a 400
naming it, never dropped. `keep_alive` has Ollama's meaning.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kinfer_rpc import __version__, errors
from kinfer_rpc.host.embeddings import Embed
from kinfer_rpc.host.options import LoadRequest, RequestOptions
from kinfer_rpc.host.reasoning import check_think
from kinfer_rpc.host.requests import Chat, Generate, Infill, Piece, Reply
from kinfer_rpc.protocol import params
from kinfer_rpc.protocol.web import ApiError, Flow, Owners, read_json, unsupported

T = TypeVar("T")

if TYPE_CHECKING:
    from kinfer_rpc.host.runtime import Loaded
    from kinfer_rpc.protocol.server import Service

# Ollama's option -> RequestOptions' field
OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
}
_FIELDS = {
    f"options.{kinfer}": f"options.{theirs}"
    for theirs, kinfer in {
        "num_predict": "maxTokens",
        "top_k": "topK",
        "top_p": "topP",
        "min_p": "minP",
        "repeat_penalty": "repeatPenalty",
        "repeat_last_n": "repeatLastN",
    }.items()
}


def field_name(kinfer: str) -> str:
    if kinfer in _FIELDS:
        return _FIELDS[kinfer]
    if kinfer == "options.format":
        return "format"
    return kinfer.removeprefix("params.")


def error_body(exc: ApiError, streaming: bool) -> tuple[int, bytes]:
    """Ollama's error shape; in a stream, as its last line."""
    data = json.dumps({"error": exc.message}).encode()
    return exc.status, (data + b"\n" if streaming else data)


def _error_response(exc: ApiError) -> Response:
    status, body = error_body(exc, False)
    return Response(body, status_code=status, media_type="application/json")


def _checked(call: Callable[[], T]) -> T:
    try:
        return call()
    except errors.KinferError as exc:
        raise ApiError.of(exc, field_name) from None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


# -- requests ------------------------------------------------------------------------------------
def _refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    extra = sorted(k for k in set(body) - known if body[k] is not None)
    if extra:
        raise unsupported(extra[0], "kinfer does not know this field")


def _options(body: dict[str, Any], constraint: tuple[str, str] | None) -> tuple[RequestOptions, int | None]:
    """Ollama's options as kinfer's, and num_ctx (the load's context) when given."""
    raw = body.get("options")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError(400, "options must be an object", "options")
    given: dict[str, Any] = {}
    num_ctx = None
    for key, value in raw.items():
        if value is None:
            continue
        if key == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < 16:
                raise ApiError(400, "options.num_ctx must be an integer of at least 16", "options.num_ctx")
            num_ctx = value
            continue
        if key not in OPTIONS:
            raise unsupported(f"options.{key}", "kinfer has no such option")
        if key in ("top_k", "repeat_last_n", "seed", "num_predict") and isinstance(value, float) and value.is_integer():
            value = int(value)
        if key == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1: until the reply ends; -2: until the context is full
        given[OPTIONS[key]] = value
    if constraint is not None:
        given["constraint"] = constraint
    return _checked(lambda: RequestOptions(**given)), num_ctx


def _format(value: object) -> tuple[str, str] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return ("format", "json")
    if isinstance(value, dict):
        return ("format", json.dumps(value))
    raise ApiError(400, 'format must be "json" or a JSON schema', "format")


def _keep_alive(body: dict[str, Any]) -> float | None:
    return _checked(lambda: params.keep_alive(body.get("keep_alive")))


def _stream(body: dict[str, Any]) -> bool:
    value = body.get("stream")
    if value is None:
        return True  # Ollama streams unless told not to
    if not isinstance(value, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    return value


def _think(body: dict[str, Any]) -> bool | str | None:
    """Ollama's `think`: true, false or a level ("max" is Ollama's "high")."""
    value = body.get("think")
    if value == "max":
        value = "high"
    return _checked(lambda: check_think(value))


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError(400, "messages must be a list", "messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{at} must be an object", at)
        message: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("images"):  # base64, as Ollama's clients send them
            message["images"] = m["images"]
        if m.get("thinking"):
            message["reasoning"] = m["thinking"]
        calls = m.get("tool_calls")
        if calls:
            message["toolCalls"] = [
                {"type": "function", "function": c.get("function")} if isinstance(c, dict) else c for c in calls
            ]
        if m.get("role") == "tool" and m.get("tool_name") is not None:
            message["name"] = m["tool_name"]
        out.append(message)
    if not out:
        raise ApiError(400, "messages must not be empty", "messages")
    return _checked(lambda: params.messages(out, paths=False))


# One line of a chat's or a generate's response: (the reply when done, its text, its thinking, done)
Shape = Callable[[Reply | None, str | None, str | None, bool], dict[str, Any]]


@attrs.frozen
class Call:
    request: Chat | Generate | Infill | None  # None: only load (or unload) the model
    model: str
    stream: bool
    num_ctx: int | None
    keep_alive: float | None


CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"}
GENERATE_FIELDS = {
    "model",
    "prompt",
    "suffix",
    "system",
    "template",
    "context",
    "stream",
    "raw",
    "format",
    "images",
    "options",
    "keep_alive",
    "think",
}


def _name(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required", "model")
    return model


def chat_request(body: dict[str, Any]) -> Call:
    _refuse_unknown(body, CHAT_FIELDS)
    think = _think(body)
    model = _name(body)
    keep = _keep_alive(body)
    options, num_ctx = _options(body, _format(body.get("format")))
    if not body.get("messages"):  # Ollama's way to load (or, keep_alive 0, unload) a model
        return Call(None, model, _stream(body), num_ctx, keep)
    messages = _messages(body.get("messages"))
    tool_list = _checked(lambda: params.tools(body.get("tools")))
    choice = _checked(lambda: params.tool_choice(None, tool_list))
    chat = Chat(tuple(messages), model, tuple(tool_list), choice, options, keep_alive=keep, think=think)
    return Call(chat, model, _stream(body), num_ctx, keep)


def generate_request(body: dict[str, Any]) -> Call:
    _refuse_unknown(body, GENERATE_FIELDS)
    think = _think(body)
    for name in ("template", "context"):
        if body.get(name):
            raise unsupported(name, "kinfer renders a model's own chat template and keeps no context tokens")
    model = _name(body)
    keep = _keep_alive(body)
    options, num_ctx = _options(body, _format(body.get("format")))
    prompt = body.get("prompt") or ""
    system = body.get("system")
    suffix = body.get("suffix")
    if not isinstance(prompt, str) or not isinstance(system, (str, type(None))):
        raise ApiError(400, "prompt and system must be strings", "prompt")
    if not prompt and not suffix:
        return Call(None, model, _stream(body), num_ctx, keep)
    request: Chat | Generate | Infill
    if (suffix or body.get("raw")) and think not in (None, False):
        raise unsupported("think", "a raw prompt or a suffix goes without the chat template, which opens the reasoning")
    if (suffix or body.get("raw")) and body.get("images"):
        raise unsupported("images", "a raw prompt or a suffix takes no images (they go through the chat template)")
    if suffix:
        if not isinstance(suffix, str):
            raise ApiError(400, "suffix must be a string", "suffix")
        request = Infill(prompt, suffix, model, options=options, keep_alive=keep)
    elif body.get("raw"):
        if system:
            raise unsupported("system", "a raw prompt takes no system message")
        request = Generate(model, prompt, None, None, options, keep)
    else:
        user: dict[str, Any] = {"role": "user", "content": prompt}
        if body.get("images"):  # the prompt's images, read through the model's chat template
            user["images"] = body["images"]
        messages = ([{"role": "system", "content": system}] if system else []) + [user]
        chat = _checked(lambda: params.messages(messages, paths=False))
        request = Chat(tuple(chat), model, options=options, keep_alive=keep, think=think)
    return Call(request, model, _stream(body), num_ctx, keep)


# -- replies -------------------------------------------------------------------------------------
def _metrics(reply: Reply, received: float, loaded_in: float) -> dict[str, Any]:
    t = reply.timings
    return {
        "total_duration": int((time.perf_counter() - received) * 1e9),
        "load_duration": int(loaded_in * 1e9),
        "prompt_eval_count": reply.usage.prompt_tokens,
        "prompt_eval_duration": int(t.prompt_ms * 1e6),
        "eval_count": reply.usage.completion_tokens,
        "eval_duration": int(t.generate_ms * 1e6),
    }


def _calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"function": {"index": i, "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
        for i, c in enumerate(reply.tool_calls or ())
    ]


def _done_reason(reply: Reply) -> str:
    return "length" if reply.stop_reason == "length" else "stop"


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode() + b"\n"


class _Lines:
    streaming = True

    def __init__(self, emit: Callable[[bytes], Awaitable[None]], line: Callable[[Piece], dict[str, Any] | None]):
        self._emit = emit
        self._line = line

    def started(self, partial: Callable[[], Reply]) -> None:
        pass

    async def piece(self, piece: Piece) -> None:
        out = self._line(piece)
        if out is not None:
            await self._emit(_line(out))


def _details(described: dict[str, Any]) -> dict[str, Any]:
    params_n = described.get("parameters")
    size = f"{params_n / 1e9:.1f}B" if params_n and params_n >= 1e9 else f"{params_n / 1e6:.0f}M" if params_n else ""
    family = described.get("architecture") or ""
    return {
        "parent_model": "",
        "format": described.get("format") or "gguf",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": size,
        "quantization_level": described.get("quantization") or "",
    }


# -- routes --------------------------------------------------------------------------------------
def routes(service: Service, owners: Owners) -> list[Route]:
    runtime = service.runtime
    requests = service.handlers.requests

    async def guarded(run: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await run()
        except ApiError as exc:
            return _error_response(exc)
        except errors.KinferError as exc:
            return _error_response(ApiError.of(exc, field_name))

    async def prepare(call: Call, owner: int) -> tuple[Loaded, float]:
        """Load the model (with num_ctx, when given), as its holder; the seconds it took."""
        t0 = time.perf_counter()
        entry = await runtime.load(
            call.model,
            request=LoadRequest(context_length=call.num_ctx) if call.num_ctx else None,
            owner=owner,
            keep_alive=call.keep_alive,
        )
        return entry, time.perf_counter() - t0

    async def run(request: Chat | Generate | Infill, sink: _Lines | None, owner: int) -> Reply:
        if isinstance(request, Chat):
            return await requests.chat(request, sink, owner=owner)
        if isinstance(request, Infill):
            return await requests.infill(request, sink, owner=owner)
        return await requests.generate(request, sink, owner=owner)

    def answer(call: Call, owner: int, received: float, shape: Shape) -> Response:
        """The response of a chat or a generate: `shape(reply, text, thinking, done)` is one line of it."""

        async def load_only(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
            entry, _ = await prepare(call, owner)
            reason = "load"
            if call.keep_alive == 0:
                await runtime.unload(entry.name)
                reason = "unload"
            return _line({**shape(None, "", None, True), "done_reason": reason})

        async def whole(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
            assert call.request is not None
            _, loaded_in = await prepare(call, owner)
            sink = None
            if call.stream:

                def line(piece: Piece) -> dict[str, Any] | None:
                    if not piece.text and not piece.reasoning:
                        return None
                    return shape(None, piece.text, piece.reasoning or None, False)

                sink = _Lines(emit, line)
            reply = await run(call.request, sink, owner)
            text, thinking = (None, None) if call.stream else (reply.text, reply.reasoning or None)
            last = {**shape(reply, text, thinking, True), "done_reason": _done_reason(reply)}
            last.update(_metrics(reply, received, loaded_in))
            return _line(last) if call.stream else json.dumps(last).encode()

        media = "application/x-ndjson" if call.stream else "application/json"
        return Flow(load_only if call.request is None else whole, media_type=media, error=error_body, fields=field_name)

    async def chat(request: Request) -> Response:
        async def parse() -> Response:
            received = time.perf_counter()
            call = chat_request(await read_json(request))

            def shape(reply: Reply | None, text: str | None, thinking: str | None, done: bool) -> dict[str, Any]:
                message: dict[str, Any] = {"role": "assistant", "content": text if text is not None else ""}
                if thinking:
                    message["thinking"] = thinking
                if reply is not None and reply.tool_calls:
                    message["tool_calls"] = _calls(reply)
                    if call.stream:
                        message["content"] = ""
                return {"model": call.model, "created_at": _now(), "message": message, "done": done}

            return answer(call, owners.of(request), received, shape)

        return await guarded(parse)

    async def generate(request: Request) -> Response:
        async def parse() -> Response:
            received = time.perf_counter()
            call = generate_request(await read_json(request))

            def shape(reply: Reply | None, text: str | None, thinking: str | None, done: bool) -> dict[str, Any]:
                out = {"model": call.model, "created_at": _now(), "response": text or "", "done": done}
                if thinking:
                    out["thinking"] = thinking
                return out

            return answer(call, owners.of(request), received, shape)

        return await guarded(parse)

    async def embed(request: Request) -> Response:
        async def parse() -> Response:
            received = time.perf_counter()
            body = await read_json(request)
            _refuse_unknown(body, {"model", "input", "truncate", "options", "keep_alive", "dimensions"})
            if body.get("options"):
                raise unsupported("options", "an embedding takes no sampling options")
            model = _name(body)
            texts = _checked(lambda: params.texts(body.get("input"), "input"))
            truncate = body.get("truncate", True)
            if not isinstance(truncate, bool):
                raise ApiError(400, "truncate must be true or false", "truncate")
            req = Embed(texts, model, True, truncate, body.get("dimensions"))
            call = Call(None, model, False, None, _keep_alive(body))
            owner = owners.of(request)

            async def whole(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
                _, loaded_in = await prepare(call, owner)
                out = await requests.embed(req)
                return json.dumps(
                    {
                        "model": out.model,
                        "embeddings": [[float(x) for x in row] for row in out.vectors],
                        "total_duration": int((time.perf_counter() - received) * 1e9),
                        "load_duration": int(loaded_in * 1e9),
                        "prompt_eval_count": out.prompt_tokens,
                    }
                ).encode()

            return Flow(whole, media_type="application/json", error=error_body, fields=field_name)

        return await guarded(parse)

    async def tags(request: Request) -> Response:
        def read() -> list[dict[str, Any]]:
            store = runtime.store
            out = []
            for ref in store.list():
                d = store.describe(ref)
                out.append(
                    {
                        "name": ref.name,
                        "model": ref.name,
                        "modified_at": _mtime(ref.path),
                        "size": ref.size_bytes,
                        "digest": "",
                        "details": _details(d),
                    }
                )
            return out

        return JSONResponse({"models": await anyio.to_thread.run_sync(read)})

    async def show(request: Request) -> Response:
        async def parse() -> Response:
            body = await read_json(request)
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(400, "model is required", "model")
            store = runtime.store

            def read() -> dict[str, Any]:
                ref = store.resolve(name)
                d = store.describe(ref)
                # a projector layer: the model reads images where the backend can (Ollama's "vision")
                capabilities = ["completion", "vision"] if ref.projector else ["completion"]
                return {
                    "license": ref.license or "",
                    "modelfile": "",
                    "parameters": "\n".join(
                        f"{k} {json.dumps(v)}" for k, v in attrs.asdict(ref.defaults).items() if v is not None
                    ),
                    "template": "",
                    "system": ref.system or "",
                    "details": _details(d),
                    "model_info": {
                        "general.architecture": d.get("architecture"),
                        "general.parameter_count": d.get("parameters"),
                        "context_length": d.get("contextLength"),
                    },
                    "capabilities": capabilities,
                    "modified_at": _mtime(ref.path),
                }

            return JSONResponse(await anyio.to_thread.run_sync(read))

        return await guarded(parse)

    async def ps(request: Request) -> Response:
        out = []
        now = time.monotonic()
        for entry in list(runtime.loaded.values()):
            model = entry.engine.model
            if model is None or not entry.ready.is_set():
                continue
            expires = entry.expires()
            until = (
                datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=max(0.0, expires - now))
                if expires is not None
                else datetime.datetime(2318, 1, 1, tzinfo=datetime.UTC)  # Ollama's "forever"
            )
            memory = model.memory() if hasattr(model, "memory") else {}
            size = int(model.info.size_bytes)
            out.append(
                {
                    "name": entry.name,
                    "model": entry.name,
                    "size": size,
                    "digest": "",
                    "details": _details({"architecture": model.info.architecture, "parameters": model.info.parameters}),
                    "expires_at": until.isoformat().replace("+00:00", "Z"),
                    "size_vram": size if memory.get("device") == "gpu" else 0,
                    "context_length": model.info.context_length,
                }
            )
        return JSONResponse({"models": out})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def pull(request: Request) -> Response:
        async def parse() -> Response:
            from kinfer_rpc.host.pull import PullError
            from kinfer_rpc.host.pull import pull as pull_model

            body = await read_json(request)
            _refuse_unknown(body, {"model", "name", "insecure", "stream"})
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(400, "model is required", "model")
            stream = _stream(body)
            insecure = bool(body.get("insecure"))

            async def run(emit: Callable[[bytes], Awaitable[None]]) -> bytes:
                send, receive = anyio.create_memory_object_stream[dict[str, Any]](float("inf"))
                loop = anyio.lowlevel.current_token()
                said: dict[str, float] = {}

                def progress(label: str, done: int, total: int | None) -> None:
                    # On the pull's thread: at most ten lines a second a file, and its last.
                    now = time.monotonic()
                    if now - said.get(label, 0.0) < 0.1 and done != total:
                        return
                    said[label] = now
                    line = {"status": f"pulling {label}", "digest": label, "total": total or 0, "completed": done}
                    anyio.from_thread.run_sync(send.send_nowait, line, token=loop)

                failure: list[str] = []

                async def work() -> None:
                    try:
                        await anyio.to_thread.run_sync(
                            lambda: pull_model(name, insecure=insecure, progress=progress), abandon_on_cancel=True
                        )
                    except PullError as exc:
                        failure.append(str(exc))
                    finally:
                        send.close()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(work)
                    if stream:
                        await emit(_line({"status": "pulling manifest"}))
                    async for line in receive:
                        if stream:
                            await emit(_line(line))
                if failure:
                    raise ApiError(400, failure[0], "model")
                done = {"status": "success"}
                return _line(done) if stream else json.dumps(done).encode()

            return Flow(run, media_type="application/x-ndjson" if stream else "application/json", error=error_body)

        return await guarded(parse)

    async def missing(request: Request) -> Response:
        return _error_response(ApiError(404, f"{request.url.path} is not an endpoint of this server"))

    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/version", version, methods=["GET"]),
        Route("/api/pull", pull, methods=["POST"]),
        Route("/api/{rest:path}", missing, methods=["GET", "POST", "DELETE", "PUT", "HEAD"]),
    ]


def _mtime(path: str) -> str:
    try:
        import os

        stamp = os.stat(path).st_mtime
    except OSError:
        stamp = 0.0
    return datetime.datetime.fromtimestamp(stamp, datetime.UTC).isoformat().replace("+00:00", "Z")
