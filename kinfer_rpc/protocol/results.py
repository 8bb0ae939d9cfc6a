"""The engine's values as the protocol's results: a reply (also the partial result of a cancel)
and a model's status. The engine keeps numbers; the JSON shapes live here."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kinfer_rpc.engine.sampling import TokenLogprob
from kinfer_rpc.engine.scheduler import EngineStats, Job


def token_logprobs(entries: Sequence[TokenLogprob], text_of: Callable[[int], str]) -> list[dict[str, Any]]:
    """Reply tokens' logprobs, each with its text and its best alternatives."""
    return [
        {
            "token": e.token,
            "text": text_of(e.token),
            "logprob": e.logprob,
            "topLogprobs": [{"token": t, "text": text_of(t), "logprob": lp} for t, lp in e.top],
        }
        for e in entries
    ]


def job_result(job: Job, text_of: Callable[[int], str] | None = None) -> dict[str, Any]:
    """A reply: text, tokens, why it stopped, its seed, usage and timings; its tokens' logprobs
    when the request asked for them (`text_of` gives a token's text)."""
    t_end = job.t_end or time.perf_counter()
    prompt_s = (job.t_first - job.t_start) if job.t_first else 0.0
    gen_s = (t_end - job.t_first) if job.t_first else 0.0
    n = len(job.generated)
    return {
        "text": job.text,
        "tokens": list(job.generated),
        "stopReason": job.stop_reason or "cancelled",
        "seed": job.options.sampling.seed,
        "usage": {
            "promptTokens": len(job.prompt),
            "completionTokens": n,
            "cachedTokens": job.cached,
            "draftTokens": job.drafted,
            "draftAccepted": job.accepted,
        },
        "timings": {
            "queueMs": round(max(0.0, (job.t_start or t_end) - job.t_submit) * 1000, 3),
            "promptMs": round(prompt_s * 1000, 3),
            "generateMs": round(gen_s * 1000, 3),
            "tokensPerSecond": round((n - 1) / gen_s, 2) if n > 1 and gen_s > 0 else 0.0,
        },
        **(
            {"logprobs": token_logprobs(job.logprobs[:n], text_of)}
            if job.options.logprobs is not None and text_of is not None
            else {}
        ),
    }


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
