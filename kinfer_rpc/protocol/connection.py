"""The JSON-RPC layer: ids, dispatch, errors, cancellation, progress. Knows nothing of inference.

Requests are dispatched with jsonrpcserver, each in a task of its own, so one slow request never
blocks another. What jsonrpcserver does not do is done here: `"params": null`, refusing batches,
`$/cancelRequest` (the request answers -32800 RequestCancelled with any partial result in
error.data), `$/progress`, and the server's own notifications and requests to the client.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, cast

import anyio
import anyio.abc
import attrs
from jsonrpcserver import Error, Result, Success, async_dispatch_to_serializable

from kinfer_rpc import errors
from kinfer_rpc.protocol.framing import FrameError

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class RequestContext:
    """Given to a handler: its request's id and tokens, and ways to report progress."""

    connection: Connection
    id: Any
    method: str
    partial_result_token: Any = None
    work_done_token: Any = None
    partial: Callable[[], Any] | None = None  # set by a handler: its partial result so far
    result: tuple[Any] | None = None  # the handler's result, once it has returned
    received: float = attrs.field(factory=time.perf_counter)  # when it arrived (traces)

    async def report_partial(self, value: Any) -> None:
        if self.partial_result_token is not None:
            await self.connection.notify("$/progress", {"token": self.partial_result_token, "value": value})

    async def work_done(self, kind: str, **fields: Any) -> None:
        if self.work_done_token is not None:
            await self.connection.notify(
                "$/progress", {"token": self.work_done_token, "value": {"kind": kind, **fields}}
            )

    def work_done_nowait(self, kind: str, **fields: Any) -> None:
        """The same, queued at once (for a request being cancelled, which must not await)."""
        if self.work_done_token is not None:
            self.connection.notify_nowait(
                "$/progress", {"token": self.work_done_token, "value": {"kind": kind, **fields}}
            )


Handler = Callable[..., Awaitable[Any]]


def progress_token(value: object, where: str) -> int | str | None:
    """LSP's ProgressToken: an integer or a string."""
    if value is None or (isinstance(value, (int, str)) and not isinstance(value, bool)):
        return value
    raise errors.invalid_params(f"{where} must be an integer or a string")


class Connection:
    """One client. `handlers` map method names to `async def handler(ctx, **params)`.

    `gate(method, is_request)` may return a KinferError to refuse a message before dispatch
    (the lifecycle uses it). `accept(method, params)` is called for each request about to start,
    in arrival order, before any later message is looked at: it may refuse the request the same
    way, or change state that the gate of later messages sees (the lifecycle's state changes).
    `send(message)` writes one message.
    """

    def __init__(
        self,
        send: Callable[[dict[str, Any]], Awaitable[None]],
        handlers: dict[str, Handler],
        notifications: dict[str, Handler],
        gate: Callable[[str, bool], errors.KinferError | None] | None = None,
        accept: Callable[[str, dict[str, Any] | list[Any]], errors.KinferError | None] | None = None,
        send_nowait: Callable[[dict[str, Any]], None] | None = None,
        owner: int = 0,
    ):
        # Which client this is, for the host: the models it holds, its fair share of their slots.
        self.owner = owner
        self.cancel_reason = "the request was cancelled"  # what a cancelled request is answered
        self._send = send
        self._send_nowait = send_nowait
        self._notifications = notifications
        self._gate = gate
        self._accept = accept
        self._running: dict[Any, tuple[anyio.CancelScope, RequestContext]] = {}
        self._pending: dict[Any, tuple[anyio.Event, list[dict[str, Any]]]] = {}
        self._ids = itertools.count(1)
        self._tg: anyio.abc.TaskGroup | None = None
        self._methods = {name: self._wrap(fn) for name, fn in handlers.items()}

    @staticmethod
    def _wrap(fn: Handler) -> Callable[..., Awaitable[Result]]:
        # Positional-only, so a param may be called `ctx` like anything else.
        async def method(ctx: RequestContext, /, **params: Any) -> Result:
            try:
                value = await fn(ctx, **params)
                ctx.result = (value,)
                return Success(value)
            except errors.KinferError as exc:
                return Error(exc.code, exc.message, exc.data)

        return method

    # -- outgoing ---------------------------------------------------------------------------
    async def notify(self, method: str, params: Any = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        await self._send(message)

    def notify_nowait(self, method: str, params: Any = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        if self._send_nowait is None:
            raise RuntimeError("this connection has no way to send without waiting")
        self._send_nowait(message)

    async def request(self, method: str, params: Any = None, timeout: float = 30.0) -> Any:
        """Send a request to the client and wait for its response (result, or raises)."""
        rid = f"kinfer-{next(self._ids)}"
        box: list[dict[str, Any]]  # the response, put there by receive()
        event, box = anyio.Event(), []
        self._pending[rid] = (event, box)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        try:
            await self._send(message)
            with anyio.fail_after(timeout):
                await event.wait()
        finally:
            self._pending.pop(rid, None)
        response = box[0]
        if "error" in response:
            err = response["error"] or {}
            raise errors.KinferError(err.get("code", errors.INTERNAL_ERROR), err.get("message", ""), err.get("data"))
        return response.get("result")

    async def _error(self, id: Any, code: int, message: str, data: Any = None) -> None:
        err: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            err["data"] = data
        await self._send({"jsonrpc": "2.0", "id": id, "error": errors.clip_echoes(err)})

    # -- incoming ---------------------------------------------------------------------------
    async def serve(self, messages: AsyncIterable[dict[str, Any] | FrameError]) -> None:
        """Handle messages until the iterator ends; requests still running are cancelled then."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            async for message in messages:
                try:
                    await self.receive(message)
                except Exception:  # never let one message stop the server
                    log.exception("failed to handle a message")
            tg.cancel_scope.cancel()

    async def receive(self, message: dict[str, Any] | FrameError) -> None:
        if isinstance(message, FrameError):
            log.warning("bad frame: %s", message.message)
            await self._error(message.id, message.code, message.message)
            return
        has_id = "id" in message
        rid = message.get("id")
        if has_id and not (rid is None or isinstance(rid, (str, int))) or isinstance(rid, bool):
            await self._error(None, errors.INVALID_REQUEST, "id must be a string, a number or null")
            return
        if message.get("jsonrpc") != "2.0":
            if has_id:
                await self._error(rid, errors.INVALID_REQUEST, 'jsonrpc must be "2.0"')
            else:
                log.warning("dropped a message without jsonrpc 2.0")
            return
        method = message.get("method")
        if method is None and has_id and ("result" in message or "error" in message):
            pending = self._pending.get(rid)
            if pending:
                pending[1].append(message)
                pending[0].set()
            else:
                log.warning("a response to no request of ours: id %r", rid)
            return
        if not isinstance(method, str):
            if has_id:
                await self._error(rid, errors.INVALID_REQUEST, "method must be a string")
            else:
                log.warning("dropped a message without a method")
            return
        params = message.get("params")
        if params is None or (method == "exit" and not has_id and not isinstance(params, (dict, list))):
            params = {}  # exit is honoured whatever its params: nothing must keep a server from ending
        if not isinstance(params, (dict, list)):
            if has_id:
                await self._error(rid, errors.INVALID_REQUEST, "params must be an object or an array")
            return
        if self._gate:
            refusal = self._gate(method, has_id)
            if refusal is not None:
                if has_id:
                    await self._error(rid, refusal.code, refusal.message, refusal.data)
                else:
                    log.info("dropped notification %s: %s", method, refusal.message)
                return
        if not has_id:
            await self._notification(method, params)
            return
        if rid in self._running:
            await self._error(rid, errors.INVALID_REQUEST, f"a request with id {rid!r} is already running")
            return
        ctx = RequestContext(self, rid, method)
        if isinstance(params, dict):
            try:
                ctx.partial_result_token = progress_token(
                    params.pop("partialResultToken", None), "params.partialResultToken"
                )
                ctx.work_done_token = progress_token(params.pop("workDoneToken", None), "params.workDoneToken")
            except errors.KinferError as exc:
                await self._error(rid, exc.code, exc.message, exc.data)
                return
        if self._accept:
            refusal = self._accept(method, params)
            if refusal is not None:
                await self._error(rid, refusal.code, refusal.message, refusal.data)
                return
        scope = anyio.CancelScope()
        self._running[rid] = (scope, ctx)
        assert self._tg is not None  # set by serve(), which is what calls receive()
        self._tg.start_soon(self._run, ctx, scope, {"jsonrpc": "2.0", "id": rid, "method": method, "params": params})

    async def _run(self, ctx: RequestContext, scope: anyio.CancelScope, request: dict[str, Any]) -> None:
        response = None
        try:
            with scope:
                # receive() checked the envelope and rebuilt it from its four members: jsonschema's
                # check of it again would only fail on deep params (its messages repr the whole
                # request, past Python's recursion limit), answered -32600 with id null.
                response = await async_dispatch_to_serializable(
                    request, methods=self._methods, context=ctx, deserializer=lambda r: r, validator=lambda r: r
                )
        finally:
            self._running.pop(ctx.id, None)
        # A cancel that came while the handler took its last step finds its reply done (the
        # dispatcher's own awaits after the handler are where it lands): that is the answer, as
        # when the cancel comes after the response.
        if scope.cancel_called and response is None and ctx.result is not None:
            response = {"jsonrpc": "2.0", "id": ctx.id, "result": ctx.result[0]}
        elif scope.cancel_called and response is None:
            partial = None
            if ctx.partial is not None:
                try:
                    partial = ctx.partial()
                except Exception:
                    log.exception("partial result failed")
            with anyio.CancelScope(shield=True):
                await self._error(ctx.id, errors.REQUEST_CANCELLED, self.cancel_reason, partial)
            return
        if response is not None:
            # One request in (never a batch), so one response object out, never a list.
            response = cast("dict[str, Any]", response)
            if isinstance(response.get("error"), dict):
                response["error"] = errors.clip_echoes(response["error"])
            await self._send(response)

    async def _notification(self, method: str, params: dict[str, Any] | list[Any]) -> None:
        if method == "$/cancelRequest":
            rid = params.get("id") if isinstance(params, dict) else None
            # Ids compare by JSON type too: true is not 1, 2.0 is not 2 (Python's == says they are).
            running = self._running.get(rid) if type(rid) in (int, str) else None
            if running:
                running[0].cancel()
            return
        handler = self._notifications.get(method)
        if handler is None:
            if not method.startswith("$/"):
                log.info("ignored unknown notification %s", method)
            return
        try:
            await handler(**params) if isinstance(params, dict) else await handler(*params)
        except Exception:
            log.exception("notification %s failed", method)

    def cancel_all(self) -> None:
        """Cancel every request still running: each is answered -32800 (with its partial result)."""
        for scope, _ in list(self._running.values()):
            scope.cancel()

    @property
    def running(self) -> int:
        """Requests not answered yet."""
        return len(self._running)
