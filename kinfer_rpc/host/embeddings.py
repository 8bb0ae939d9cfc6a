"""Embedding and reranking, from a typed request to a typed reply: which model (one loaded to embed:
kinfer_rpc.types.Embeds), the inputs tokenized and cut to its context, the passes run on the
model's worker, the vectors cut to the asked size and normalized, or the documents ranked.

Every step after the model's passes is done row by row, in an order that depends on the row
alone (the norm is an exactly rounded sum), so a vector is the same bit for bit whether it was
embedded alone, in a list, or while other requests were embedding theirs; the backend's passes
promise the same (Embeds.embed).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import anyio
import attrs
import numpy as np

from kinfer_rpc import errors
from kinfer_rpc.host.runtime import Loaded, Runtime
from kinfer_rpc.types import BackendFeatures, Embeds, LoadedModel, Reranks

# Inputs one call to the model's worker embeds; a request keeps at most IN_FLIGHT calls queued,
# so requests embedding at the same time take turns at this size.
CALL_INPUTS = 8
IN_FLIGHT = 2
# With truncate, an input is cut to this many characters a token of context before it is tokenized
# (no vocabulary spells a token with more): a huge input costs no more than its first tokens.
TOKEN_CHARS = 256


@attrs.frozen
class Embed:
    """Embed each input: `normalize` to unit length; `truncate` cuts an input too long for the
    model's context (else it is refused); `dimensions` cuts each vector to that many (a size the
    model was trained to be cut to)."""

    inputs: tuple[str, ...]
    model: str | None = None
    normalize: bool = True
    truncate: bool = True
    dimensions: int | None = None


@attrs.frozen
class Rerank:
    """Score each document's relevance to the query with a reranker; the best `top_n` (all when
    None), best first, with their text when `return_documents`."""

    query: str
    documents: tuple[str, ...]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False


@attrs.frozen(eq=False)
class Embeddings:
    model: str
    vectors: np.ndarray  # float32, one row an input
    prompt_tokens: int


@attrs.frozen
class Ranked:
    index: int  # of the document in the request
    score: float
    document: str | None = None


@attrs.frozen
class Ranking:
    model: str
    results: tuple[Ranked, ...]
    prompt_tokens: int


def _embedder(runtime: Runtime, entry: Loaded, method: str) -> Embeds:
    """The entry's model as an Embeds, or the error that says what to use instead."""
    model = entry.engine.model
    if isinstance(model, Embeds):
        return model
    backend = runtime.plugins.backends.get(entry.backend)
    features: dict[str, Any] = backend.features() if isinstance(backend, BackendFeatures) else {}
    if not features.get("embeddings"):
        raise errors.KinferError(
            errors.NOT_SUPPORTED,
            f"the {entry.backend} backend does not embed; an embedding model in GGUF runs on the llama backend",
            {"model": entry.name},
        )
    raise errors.invalid_params(
        f"model {entry.name!r} is not an embedding model: its file declares no pooling, and it is loaded to "
        f"generate; {method} needs an embedding model (a GGUF whose {{arch}}.pooling_type is mean, cls or last, "
        "or rank for inference/rerank), e.g. one made by llama.cpp's convert_hf_to_gguf.py",
        {"field": "model", "pooling": None},
    )


def refuse_generation(entry: Loaded) -> None:
    """-32602 for a generation request on a model loaded to embed."""
    model = entry.engine.model
    if isinstance(model, Embeds):
        what = "a reranker" if model.pooling == "rank" else "an embedding model"
        use = "inference/rerank" if model.pooling == "rank" else "inference/embed"
        raise errors.invalid_params(
            f"model {entry.name!r} is {what} (pooling {model.pooling}): it does not generate; use {use}",
            {"field": "model", "pooling": model.pooling},
        )


def _fit(tokens: list[int], tail: list[int], context: int, truncate: bool, index: int) -> list[int]:
    """An input's tokens cut to the context: its first tokens, then the special tokens the
    tokenizer ends every input with (`tail`, BERT's [SEP]); -31002 when it may not be cut."""
    if len(tokens) <= context:
        return tokens
    if not truncate:
        raise errors.KinferError(
            errors.CONTEXT_OVERFLOW,
            f"input {index} is {len(tokens)} tokens but the model's context holds {context} (truncate cuts it)",
            {"promptTokens": len(tokens), "contextLength": context, "index": index},
        )
    if tail and tokens[-len(tail) :] == tail:
        return [*tokens[: context - len(tail)], *tail]
    return tokens[:context]


def _normalized(vectors: np.ndarray, dims: int | None, normalize: bool) -> np.ndarray:
    """Each row cut to `dims` and scaled to unit length, one row at a time: the norm is an
    exactly rounded sum of its squares, so it depends on the row's values alone."""
    out = vectors[:, :dims] if dims is not None else vectors
    if not normalize:
        return np.ascontiguousarray(out, dtype=np.float32)
    rows = []
    for row in out:
        wide = row.astype(np.float64)
        norm = math.sqrt(math.fsum((wide * wide).tolist()))
        rows.append((wide / norm).astype(np.float32) if norm > 0 else row.astype(np.float32))
    return np.stack(rows) if rows else np.zeros((0, out.shape[1]), dtype=np.float32)


def _embed_on_worker(token_lists: Sequence[list[int]], model: LoadedModel) -> np.ndarray:
    """On the model's worker: Embeds.embed (the host checked the capability)."""
    assert isinstance(model, Embeds), "only an embedding model is asked to embed"
    return np.asarray(model.embed(token_lists), dtype=np.float32)


async def _run(entry: Loaded, token_lists: Sequence[list[int]]) -> np.ndarray:
    """The model's rows for every token list, CALL_INPUTS at a time on its worker, two calls in
    flight (the next one waits on the worker while this one's rows come back)."""
    chunks = [token_lists[i : i + CALL_INPUTS] for i in range(0, len(token_lists), CALL_INPUTS)]
    pending: list[Future[np.ndarray]] = []
    parts = []
    try:
        for i in range(len(chunks)):
            while len(pending) < IN_FLIGHT and i + len(pending) < len(chunks):
                pending.append(entry.engine.call(functools.partial(_embed_on_worker, chunks[i + len(pending)])))
            try:
                parts.append(await asyncio.wrap_future(pending.pop(0)))
            except errors.KinferError:
                raise
            except Exception as exc:  # the backend failed a pass: this request's error, the model goes on
                raise errors.KinferError(errors.INTERNAL_ERROR, f"embedding failed: {exc}") from exc
    finally:
        for future in pending:  # cancelled or failed: what has not started is dropped
            future.cancel()
    return np.concatenate(parts)


async def embed(runtime: Runtime, req: Embed) -> Embeddings:
    if not req.inputs:
        raise errors.invalid_params("params.input is empty: give a string or a list of strings", {"field": "input"})
    entry = await runtime.model_for(req.model)
    model = _embedder(runtime, entry, "inference/embed")
    if model.pooling == "rank":
        raise errors.invalid_params(
            f"model {entry.name!r} is a reranker (pooling rank): it scores pairs with inference/rerank",
            {"field": "model", "pooling": "rank"},
        )
    if req.dimensions is not None and req.dimensions not in model.dimensions:
        sizes = ", ".join(map(str, model.dimensions)) if model.dimensions else "none: its vectors are whole only"
        raise errors.invalid_params(
            f"params.dimensions {req.dimensions}: model {entry.name!r} says which sizes its vectors may be cut to "
            f"({sizes})",
            {"field": "dimensions", "dimensions": list(model.dimensions)},
        )
    context = model_info(entry).context_length

    def tokenize() -> list[list[int]]:
        with entry.engine.hold() as held:
            added = held.tokenize("", True, False)  # the special tokens every input gets: [CLS] [SEP]
            tail = added[1:] if added and held.info.add_bos else added
            out = []
            for i, text in enumerate(req.inputs):
                if req.truncate:  # a context's worth of tokens never takes more than this to spell
                    text = text[: context * TOKEN_CHARS]
                tokens = _fit(held.tokenize(text, True, False), tail, context, req.truncate, i)
                if not tokens:
                    raise errors.invalid_params(f"input {i} is empty (0 tokens)", {"field": "input"})
                out.append(tokens)
            return out

    token_lists = await anyio.to_thread.run_sync(tokenize, limiter=entry.tokenizer)
    vectors = await _run(entry, token_lists)
    return Embeddings(entry.name, _normalized(vectors, req.dimensions, req.normalize), sum(map(len, token_lists)))


async def rerank(runtime: Runtime, req: Rerank) -> Ranking:
    if not req.documents:
        raise errors.invalid_params("params.documents is empty", {"field": "documents"})
    entry = await runtime.model_for(req.model)
    model = _embedder(runtime, entry, "inference/rerank")
    if model.pooling != "rank" or not isinstance(model, Reranks):
        raise errors.invalid_params(
            f"model {entry.name!r} is not a reranker (pooling {model.pooling}): inference/rerank needs a reranker "
            "(a GGUF whose pooling is rank, with a classification head); it embeds with inference/embed",
            {"field": "model", "pooling": model.pooling},
        )
    context = model_info(entry).context_length
    reranker = model

    def tokenize() -> list[list[int]]:
        with entry.engine.hold():
            out = []
            for i, doc in enumerate(req.documents):
                tokens = reranker.pair_tokens(req.query, doc)
                if len(tokens) > context:
                    raise errors.KinferError(
                        errors.CONTEXT_OVERFLOW,
                        f"the query and document {i} are {len(tokens)} tokens but the model's context holds {context}",
                        {"promptTokens": len(tokens), "contextLength": context, "index": i},
                    )
                out.append(tokens)
            return out

    token_lists = await anyio.to_thread.run_sync(tokenize, limiter=entry.tokenizer)
    scores = (await _run(entry, token_lists))[:, 0]
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))  # best first; ties by index
    top = order[: req.top_n] if req.top_n is not None else order
    results = tuple(Ranked(i, float(scores[i]), req.documents[i] if req.return_documents else None) for i in top)
    return Ranking(entry.name, results, sum(map(len, token_lists)))


def model_info(entry: Loaded) -> Any:
    model = entry.engine.model
    if model is None:
        raise errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded")
    return model.info
