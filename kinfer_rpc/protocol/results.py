"""The host's values as the protocol's results: a reply (also the partial result of a cancel), a
streamed piece of one, and a model's status. The host keeps typed values; the JSON shapes live here."""

from __future__ import annotations

from typing import Any

from kinfer_rpc.host.embeddings import Embeddings, Ranking
from kinfer_rpc.host.requests import Logprob, Piece, Reply
from kinfer_rpc.host.runtime import EngineStats


def logprobs_json(entries: tuple[Logprob, ...]) -> list[dict[str, Any]]:
    """Reply tokens' logprobs, each with its text and its best alternatives."""
    return [
        {
            "token": e.token,
            "text": e.text,
            "logprob": e.logprob,
            "topLogprobs": [{"token": t, "text": text, "logprob": lp} for t, text, lp in e.top],
        }
        for e in entries
    ]


def reply_json(reply: Reply, *, model: bool = True) -> dict[str, Any]:
    """A reply: (its model,) text, tokens, why it stopped, its seed, usage and timings; a
    thinking model's reasoning; its tokens' logprobs when the request asked for them; a chat's
    tool calls; what an infill left out of its context."""
    u, t = reply.usage, reply.timings
    out: dict[str, Any] = {"model": reply.model} if model else {}
    out.update(
        text=reply.text,
        tokens=list(reply.tokens),
        stopReason=reply.stop_reason,
        seed=reply.seed,
        usage={
            "promptTokens": u.prompt_tokens,
            "completionTokens": u.completion_tokens,
            "cachedTokens": u.cached_tokens,
            "draftTokens": u.draft_tokens,
            "draftAccepted": u.draft_accepted,
            "reasoningTokens": u.reasoning_tokens,
        },
        timings={
            "queueMs": t.queue_ms,
            "promptMs": t.prompt_ms,
            "generateMs": t.generate_ms,
            "tokensPerSecond": t.tokens_per_second,
        },
    )
    if reply.reasoning is not None:
        out["reasoning"] = reply.reasoning
    if reply.logprobs is not None:
        out["logprobs"] = logprobs_json(reply.logprobs)
    if reply.tool_calls is not None:
        out["toolCalls"] = list(reply.tool_calls)
    if reply.dropped is not None:
        out["dropped"] = reply.dropped
    return out


def piece_json(piece: Piece) -> dict[str, Any]:
    """A streamed piece: its text and tokens, its reasoning (when it has some), their logprobs
    when asked, the tool calls it completed."""
    out: dict[str, Any] = {"text": piece.text, "tokens": list(piece.tokens)}
    if piece.reasoning:
        out["reasoning"] = piece.reasoning
    if piece.logprobs is not None:
        out["logprobs"] = logprobs_json(piece.logprobs)
    if piece.tool_calls:
        out["toolCalls"] = list(piece.tool_calls)
    return out


def engine_status(stats: EngineStats) -> dict[str, Any]:
    """A loaded model's part of model/status."""
    return {
        "slots": stats.slots,
        "slotsBusy": stats.busy,
        "queueLength": stats.queued,
        "cellsUsed": stats.cells_used,
        "prefix": stats.prefix,
        "cachedTokens": stats.cached_tokens,
        "prefixHits": stats.prefix_hits,
        "tokensPerSecond": round(stats.tokens_per_second, 2),
        "steps": stats.steps,
        "draftTokens": stats.draft_tokens,
        "draftAcceptance": round(stats.draft_accepted / stats.draft_tokens, 4) if stats.draft_tokens else 0.0,
        "memory": stats.memory,
    }


def embeddings_json(out: Embeddings) -> dict[str, Any]:
    """Each input's vector (float32 values, written exactly), in input order."""
    return {"model": out.model, "embeddings": out.vectors.tolist(), "usage": {"promptTokens": out.prompt_tokens}}


def ranking_json(out: Ranking) -> dict[str, Any]:
    """The documents ranked, best first: each one's index, score, and text when asked."""
    results = [
        {"index": r.index, "relevanceScore": r.score, **({"document": r.document} if r.document is not None else {})}
        for r in out.results
    ]
    return {"model": out.model, "results": results, "usage": {"promptTokens": out.prompt_tokens}}
