"""The `model/*` and `inference/*` methods: params in as the host's typed requests, the host's
replies out as results (kinfer_rpc.host.requests does the work).

Each handler receives the request's context (kinfer_rpc.protocol.connection.RequestContext) for
work-done progress and partial results.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from kinfer_rpc import errors
from kinfer_rpc.host.embeddings import Embed, Rerank
from kinfer_rpc.host.reasoning import check_think
from kinfer_rpc.host.requests import Chat, Generate, Infill, Piece, Reply, Requests, Sink, Tokenize
from kinfer_rpc.host.runtime import Loaded, Runtime, reproducibility
from kinfer_rpc.protocol import params
from kinfer_rpc.protocol.connection import RequestContext
from kinfer_rpc.protocol.fields import Fields
from kinfer_rpc.protocol.options import load_request, request_options
from kinfer_rpc.protocol.results import embeddings_json, engine_status, piece_json, ranking_json, reply_json
from kinfer_rpc.types import LoadedModel, LoadOptions, Vision


class _Progress:
    """A load's progress as the request's work-done progress."""

    def __init__(self, ctx: RequestContext):
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()

    async def begin(self, title: str) -> None:
        await self.ctx.work_done("begin", title=title, cancellable=False, percentage=0)

    def report(self, percentage: int, message: str) -> None:
        if self.ctx.work_done_token is not None:
            self.loop.create_task(self.ctx.work_done("report", percentage=percentage, message=message))

    def end(self, message: str) -> None:
        self.ctx.work_done_nowait("end", message=message)


def list_seconds() -> float:
    """How long model/list waits for the stores (KINFER_LIST_SECONDS, default 30)."""
    try:
        return max(0.1, float(os.environ.get("KINFER_LIST_SECONDS", "30")))
    except ValueError:
        return 30.0


class Handlers:
    """The methods the server registers, over one Runtime."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.requests = Requests(runtime)
        self.renderer = self.requests.renderer
        # model/list's store reads that ran out of time and are still running (stuck in a hung file
        # system?): no other starts meanwhile, so a hung store never takes more than one thread
        self._stuck_reads = 0
        self._stuck_lock = threading.Lock()

    # -- models ------------------------------------------------------------------------------
    async def model_list(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        Fields(p, "params").done()
        store = self.runtime.store
        seconds = list_seconds()
        if self._stuck_reads:  # a read that ran out of time is still stuck: don't start another
            raise errors.KinferError(
                errors.INTERNAL_ERROR,
                f"the model stores could not be read within {seconds:g} s (a hung file system?); "
                "the read is still waiting",
            )
        refs: list[Any] = []
        described: list[dict[str, Any]] = []
        state = {"done": False, "stuck": False}

        def read() -> None:  # off the loop; what it has done so far counts if it runs out of time
            try:
                refs.extend(store.list())
                for ref in refs:
                    described.append(store.describe(ref))
            finally:
                with self._stuck_lock:
                    state["done"] = True
                    if state["stuck"]:
                        self._stuck_reads -= 1

        # A store on a hung file system must not hang the answer: after `seconds` the list is what
        # was read by then, each model not read yet with an error (the thread is left to finish).
        with anyio.move_on_after(seconds) as scope:
            await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        if scope.cancelled_caught:
            with self._stuck_lock:
                if not state["done"]:
                    state["stuck"] = True
                    self._stuck_reads += 1
            if not refs:
                raise errors.KinferError(
                    errors.INTERNAL_ERROR,
                    f"the model stores could not be listed within {seconds:g} s (a hung file system?)",
                )
        done = list(described)
        late = {"error": f"its header could not be read within {seconds:g} s (a hung file system?)"}
        done += [{**store.listed(ref), **late} for ref in refs[len(done) :]]
        return {"models": [{**d, "loaded": d["name"] in self.runtime.loaded} for d in done]}

    async def model_load(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        backend = f.str("backend")
        options = f.raw("options")
        keep = params.keep_alive(f.raw("keepAlive"))
        pin = f.bool("pin", None)
        f.done()
        request = load_request(options)
        evicted: list[str] = []
        entry = await self.runtime.load(
            name,
            backend,
            request,
            _Progress(ctx) if ctx is not None else None,
            owner=ctx.connection.owner if ctx is not None else None,
            keep_alive=keep,
            pin=pin,
            evicted=evicted,
        )
        return {**self._describe(entry), **({"evicted": evicted} if evicted else {})}

    def _describe(self, entry: Loaded) -> dict[str, Any]:
        model = entry.engine.model
        assert model is not None  # a loaded entry's engine holds its model
        info = model.info
        return {
            "model": entry.name,
            "backend": entry.backend,
            "path": info.path,
            "source": entry.source,
            "architecture": info.architecture,
            "parameters": info.parameters,
            "sizeBytes": info.size_bytes,
            "contextLength": info.context_length,
            "contextTrain": info.context_train,
            "slots": info.slots,
            "batch": entry.options.batch,
            "ubatch": entry.options.ubatch,
            "gpuLayers": entry.options.gpu_layers,
            "flashAttention": entry.options.flash_attention,
            "draftPolicy": entry.draft_policy,
            "prefix": entry.engine.prefix,
            "drafts": info.drafts,
            "weights": info.weights,
            "reproducible": self._reproducible(model),
            **self._placement_fields(entry),
            **self._template_fields(entry),
            "ignoredParameters": [{"name": n, "reason": why} for n, why in entry.ignored],
            **_sharing(entry),
            **({"devices": [dict(d) for d in info.devices]} if info.devices else {}),
            **({"rpcServers": list(entry.options.rpc_servers)} if entry.options.rpc_servers else {}),
            **self._split_fields(entry.options),
        }

    @staticmethod
    def _split_fields(opts: LoadOptions) -> dict[str, Any]:
        """How the layers were spread over several GPUs, where the placement or the options said."""
        out: dict[str, Any] = {}
        if opts.split_mode is not None:
            out["splitMode"] = opts.split_mode
        if opts.tensor_split:
            out["tensorSplit"] = list(opts.tensor_split)
        if opts.main_gpu is not None:
            out["mainGpu"] = opts.main_gpu
        return out

    @staticmethod
    def _template_fields(entry: Loaded) -> dict[str, Any]:
        """Which chat template chats use; where an Ollama model brought a Go template (which kinfer
        never runs), a note saying what is used instead."""
        used = "gguf" if entry.engine.template else "chatml"
        out: dict[str, Any] = {"chatTemplate": used}
        if entry.go_template:
            instead = "the GGUF's own chat template" if used == "gguf" else "ChatML (the GGUF has no chat template)"
            out["chatTemplateNote"] = f"Ollama's Go template is not run: chats use {instead}"
        return out

    @staticmethod
    def _reproducible(model: LoadedModel) -> dict[str, Any]:
        promised, reason = reproducibility(model)
        return {"promised": promised, "reason": reason}

    @staticmethod
    def _placement_fields(entry: Loaded) -> dict[str, Any]:
        return {
            "placement": entry.placement,
            "placementReason": entry.placement_reason,
            "hostTensors": list(entry.options.host_tensors),
        }

    async def model_unload(self, ctx: RequestContext | None, /, **p: Any) -> None:
        f = Fields(p, "params")
        name = f.str("model")
        f.done()
        if not name:
            raise errors.invalid_params("params.model is required (the name of a loaded model)")
        before = dict(self.runtime.loaded)
        await self.runtime.unload(name)
        for gone in (e for n, e in before.items() if self.runtime.loaded.get(n) is not e):
            self.renderer.stop(gone)  # its chats' renders end now, with an error
        return None

    async def model_status(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        f.done()
        out: list[dict[str, Any]] = [
            {"model": failed, "backend": backend, "state": "failed", "error": error}
            for failed, (backend, error) in self.runtime.failed.items()
            if name is None or failed == name
        ]
        for entry in list(self.runtime.loaded.values()):
            if name is not None and entry.name != name:
                continue
            if not entry.ready.is_set() or entry.error is not None:
                out.append({"model": entry.name, "backend": entry.backend, "state": "loading"})
                continue
            model = entry.engine.model  # None once an unload has begun
            out.append(
                {
                    "model": entry.name,
                    "backend": entry.backend,
                    "state": "ready",
                    **engine_status(entry.engine.stats()),
                    "batch": entry.options.batch,
                    "ubatch": entry.options.ubatch,
                    "gpuLayers": entry.options.gpu_layers,
                    **({"reproducible": self._reproducible(model)} if model is not None else {}),
                    # a model that reads images: how many its projector encoded, and how many came
                    # from the cache of images it encoded before
                    **({"images": model.media_stats()} if isinstance(model, Vision) and model.vision else {}),
                    **self._placement_fields(entry),
                    **_sharing(entry),
                }
            )
        return {"models": out}

    async def inference_generate(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        prompt = f.str("prompt")
        tokens = f.raw("tokens")
        suffix = f.str("suffix")
        add_special = f.bool("addSpecial", None)
        options = f.raw("options")
        keep = params.keep_alive(f.raw("keepAlive"))
        f.done()
        if (prompt is None) == (tokens is None):
            raise errors.invalid_params("give exactly one of params.prompt and params.tokens")
        if suffix is not None:  # Ollama's fill-in-the-middle: the prompt is the text before the gap
            if prompt is None or add_special is not None:
                raise errors.invalid_params(
                    "params.suffix goes with params.prompt (not tokens or addSpecial)", {"field": "params.suffix"}
                )
            req = Infill(prompt, suffix, name, options=request_options(options), keep_alive=keep)
            return reply_json(await self.requests.infill(req, **_call(ctx)))
        ids = params.tokens(tokens) if tokens is not None else None
        gen = Generate(name, prompt, ids, add_special, request_options(options), keep)
        return reply_json(await self.requests.generate(gen, **_call(ctx)))

    async def inference_infill(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        prefix = f.str("prefix")
        suffix = f.str("suffix", "")
        middle = f.str("middle")
        extra = params.infill_extra(f.raw("extra"))
        options = f.raw("options")
        keep = params.keep_alive(f.raw("keepAlive"))
        f.done()
        if prefix is None:
            raise errors.invalid_params("params.prefix is required", {"field": "params.prefix"})
        opts = request_options(options, infill=True)
        req = Infill(prefix, suffix, name, tuple(extra), opts, keep, middle=middle)
        return reply_json(await self.requests.infill(req, **_call(ctx)))

    async def inference_chat(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        raw = f.raw("messages")
        if isinstance(raw, list) and any(isinstance(m, dict) and m.get("images") for m in raw):
            # images by path are read from files: off the event loop (a slow disk stalls this request alone)
            messages = await anyio.to_thread.run_sync(params.messages, raw)
        else:
            messages = params.messages(raw)
        options = f.raw("options")
        tool_list = params.tools(f.raw("tools"))
        choice = params.tool_choice(f.raw("toolChoice"), tool_list)
        parallel = f.bool("parallelToolCalls", True)
        keep = params.keep_alive(f.raw("keepAlive"))
        think = check_think(f.raw("think"))
        f.done()
        opts = request_options(options)
        req = Chat(tuple(messages), name, tuple(tool_list), choice, opts, parallel, keep_alive=keep, think=think)
        return reply_json(await self.requests.chat(req, **_call(ctx)))

    async def inference_tokenize(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        text = f.str("text")
        add_special = f.bool("addSpecial", None)
        parse_special = f.bool("parseSpecial", True)
        f.done()
        if text is None:
            raise errors.invalid_params("params.text is required")
        out = await self.requests.tokenize(Tokenize(text, name, add_special, parse_special))
        return {"tokens": list(out.tokens), "pieces": list(out.pieces)}

    async def inference_embed(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        raw = f.raw("input")
        normalize = f.bool("normalize", True)
        truncate = f.bool("truncate", True)
        dimensions = f.int("dimensions", None, lo=1)
        f.done()
        if raw is None:
            raise errors.invalid_params("params.input is required", {"field": "params.input"})
        req = Embed(params.texts(raw, "input"), name, normalize, truncate, dimensions)
        return embeddings_json(await self.requests.embed(req))

    async def inference_rerank(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        query = f.str("query")
        raw = f.raw("documents")
        top_n = f.int("topN", None, lo=1)
        return_documents = f.bool("returnDocuments", False)
        f.done()
        if query is None or raw is None:
            missing = "query" if query is None else "documents"
            raise errors.invalid_params(f"params.{missing} is required", {"field": f"params.{missing}"})
        req = Rerank(query, params.texts(raw, "documents", one=False), name, top_n, return_documents)
        return ranking_json(await self.requests.rerank(req))


def _sharing(entry: Loaded) -> dict[str, Any]:
    """Who holds a loaded model and how long it stays: holders (connections), loads (model/load
    calls it answered), pinned, keepAlive (seconds, -1: until unloaded), expiresIn (seconds, when
    idle; absent while it never expires)."""
    expires = entry.expires()
    out: dict[str, Any] = {
        "holders": len(entry.holders),
        "loads": entry.loads,
        "pinned": entry.pinned,
        "keepAlive": -1 if entry.keep_alive == float("inf") else entry.keep_alive,
    }
    if expires is not None:
        out["expiresIn"] = round(max(0.0, expires - time.monotonic()), 1)
    return out


class _Streamed(Sink):
    """A reply streamed as the request's partial results ($/progress with its partialResultToken)."""

    def __init__(self, ctx: RequestContext):
        self.ctx = ctx
        self.streaming = ctx.partial_result_token is not None

    def started(self, partial: Callable[[], Reply]) -> None:
        self.ctx.partial = lambda: reply_json(partial(), model=False)

    async def piece(self, piece: Piece) -> None:
        await self.ctx.report_partial(piece_json(piece))


def _call(ctx: RequestContext | None) -> dict[str, Any]:
    """Who asked, as the flows take it: where the reply streams to, the connection (which holds
    the model and shares its slots fairly with the others), when the request arrived."""
    if ctx is None:
        return {}
    sink: Sink = _Streamed(ctx)
    return {"sink": sink, "owner": ctx.connection.owner, "received": ctx.received}
