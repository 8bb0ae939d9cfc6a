"""Public types shared by the host, the engine and plugins.

A plugin imports only this module and kinfer_rpc.hookspecs. The engine talks to a backend through
the `Backend` and `LoadedModel` protocols below and never imports a backend's library.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

import attrs


def kinfer_home() -> Path:
    """Where kinfer keeps its files ($KINFER_HOME, else ~/.kinfer); a plugin keeps its own under
    it (the mlx backend: MLX's compiled CUDA kernels in cache/mlx-ptx)."""
    return Path(os.environ.get("KINFER_HOME") or Path.home() / ".kinfer")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences (the prefix pool's and drafters' test
    of what cached cells still hold)."""
    n = min(len(a), len(b))
    if n and list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@attrs.frozen
class LoadOptions:
    """What `model/load` asked for, after the placement filled in what it decides.

    `context_length` is the context of ONE sequence (one slot): a load of 4 slots at 2048 holds
    4 x 2048 cells. `batch` is how many tokens one decode pass takes; `ubatch` the physical
    micro-batch. `gpu_layers` -1 means every layer. `host_tensors` are tensor-name patterns kept in
    host memory (placements). `kv_unified` False gives every slot its own KV stream, which is
    what keeps replies independent of their neighbours.
    """

    context_length: int = 4096
    slots: int = 4
    batch: int = 2048
    ubatch: int = 512
    threads: int | None = None
    gpu_layers: int = -1
    flash_attention: bool = True
    kv_unified: bool = False
    host_tensors: tuple[str, ...] = ()
    drafts: int | None = 0  # draft tokens one sequence checks in a pass; None: the backend's choice
    draft_model: str | None = None  # path of the draft-model policy's GGUF (same vocabulary)
    mtp: bool = False  # load the model's multi-token-prediction layers (the mtp policy)
    kv_type: str | None = None  # KV cache cell type ("f16", "q8_0"); None: the backend's choice
    # "quantized": the weights as the model stores them; "dense": quantized weights expanded to
    # the float type at load (backends that can: `Backend.weights`); None: the backend's choice
    weights: str | None = None
    # Whether replies must be the same for the same request whatever else runs (batch invariance):
    # True: a load that cannot promise it fails; False: the backend may pick faster kernels that
    # do not promise it; None: the backend's default, the promise wherever it can keep it.
    reproducible: bool | None = None
    # llama.cpp's RPC servers ("host:port", `ggml-rpc-server`) whose devices join the load's: the
    # offloaded layers are spread over the local GPUs and theirs
    rpc_servers: tuple[str, ...] = ()
    # each device's share of the offloaded layers, in device order (llama.cpp's tensor_split);
    # empty: in proportion to each device's free memory
    tensor_split: tuple[float, ...] = ()
    # how the offloaded layers are spread over several GPUs (llama.cpp's split_mode): "layer"
    # (each GPU a range of layers), "row" (every weight matrix cut by rows over the GPUs), "tensor"
    # (every matrix and the KV cache cut over the GPUs, their results summed: tensor parallelism),
    # "none" (all on `main_gpu`); None: not set (llama.cpp's default, "layer")
    split_mode: str | None = None
    # the GPU (index in MachineInfo.gpus) that holds the whole model with split_mode "none", and
    # the small tensors and intermediate results with "row"; None: not set (llama.cpp's 0)
    main_gpu: int | None = None
    # the model's vision projector (llama.cpp's mmproj GGUF): images in prompts (Vision); None:
    # text only
    projector: str | None = None


@attrs.frozen
class SeqChunk:
    """Tokens of one sequence for one decode pass.

    `pos` is the position of `tokens[0]`. `outputs` is how many of the trailing tokens need
    logits (0 for a prompt chunk that does not end the prompt, 1 for the last prompt token or a
    decode token, k+1 when k drafts are verified).
    """

    seq: int
    pos: int
    tokens: Sequence[int]
    outputs: int = 1
    # Drafts still on the device (a DeviceTokens model only): `(handles, row)` stands in for
    # tokens[1:], token 1 + j being row `row` of handles[j] (launched_tokens() of passes of a
    # model of the same backend); tokens[1:] then only hold their count.
    device_tokens: tuple[Sequence[Any], int] | None = None


@attrs.frozen
class ModelInfo:
    """What a loaded model tells the engine about itself."""

    name: str
    path: str
    backend: str
    n_vocab: int
    context_length: int
    slots: int
    architecture: str = ""
    parameters: int = 0
    size_bytes: int = 0
    context_train: int = 0
    description: str = ""
    bos_text: str = ""
    eos_text: str = ""
    add_bos: bool = False
    drafts: int = 0  # draft tokens per step this load was made for (fixed for its life)
    weights: str = "quantized"  # "quantized" (as stored) or "dense" (expanded to floats at load)
    # where the layers went, where a backend says: ({"device", "server", "layers": [[first, last],
    # ...]}, ...) with `server` the RPC server's "host:port" (None for a local device); the output
    # layer is number n_layer
    devices: tuple[dict[str, Any], ...] = ()


@runtime_checkable
class LoadedModel(Protocol):
    """A model a backend loaded, owned by exactly one engine thread.

    `decode(chunks)` starts ONE pass over every chunk and returns a function that waits for it
    and returns the logits of the rows that asked for them, in chunk order, as a float32 array
    of shape (sum(outputs), n_vocab); the array may be a view of the backend's buffer, valid
    until the next decode. Between the two the engine does host work while the device computes.
    The sequence ids are 0..slots-1 (a slot's id). `tokenize`, `token_bytes`, `eog_tokens` and
    `chat_template` may be called from any thread; everything else only from the engine thread.
    """

    info: ModelInfo

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def eog_tokens(self) -> Iterable[int]: ...

    def chat_template(self) -> str | None: ...

    def decode(self, chunks: Sequence[SeqChunk]) -> Callable[[], np.ndarray]: ...

    def seq_remove(self, seq: int, start: int = 0, end: int = -1) -> None: ...

    def seq_copy(self, src: int, dst: int, start: int = 0, end: int = -1) -> None: ...

    def memory(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class DeviceGreedy(Protocol):
    """Optional LoadedModel capability: greedy rows' argmax taken on the device.

    With `device_greedy` true, `set_device_greedy(seq, on)` says whether that sequence's output
    rows are sampled greedily on the device from the next pass on (False if it cannot), and
    `sampled_tokens()`, after a pass's wait, gives one token per output row (-1 for rows it did
    not sample; their logits are in the array the wait returned).
    """

    device_greedy: bool

    def set_device_greedy(self, seq: int, on: bool) -> bool: ...

    def sampled_tokens(self) -> list[int]: ...


@runtime_checkable
class DeviceArgmax(Protocol):
    """Optional LoadedModel capability, with DeviceGreedy: `set_device_argmax(seq, on)` says
    whether that sequence's output rows get their argmax taken on the device from the next pass
    on while their logits still come back (False if it cannot); `sampled_tokens()` then gives
    it for those rows too (-1 for a row without a largest value). The engine asks it for greedy
    rows that it masks before choosing (replies held to a grammar): the row's best token comes
    from the device in every pass, so the choice never depends on the pass's other rows.
    """

    def set_device_argmax(self, seq: int, on: bool) -> bool: ...


@runtime_checkable
class AsyncDecode(Protocol):
    """Optional LoadedModel capability: `decode_async` true when decode() returns before the pass
    is done (it queues the pass on a device). The engine may then start a pass before taking the
    tokens of the one before, so the device does not wait for that bookkeeping."""

    decode_async: bool


@runtime_checkable
class DecodeNext(Protocol):
    """Optional LoadedModel capability, with AsyncDecode: `decode_next(tokens)` is decode() of the
    last pass's rows one token further (row i's sequence gets tokens[i] at its next position).
    Called only right after a pass whose rows were one token each, all asking for logits, with no
    cells removed or copied and no set_device_greedy since; raises ValueError otherwise."""

    def decode_next(self, tokens: Sequence[int]) -> Callable[[], np.ndarray]: ...


@runtime_checkable
class DecodeChained(Protocol):
    """Optional LoadedModel capability, with AsyncDecode and DeviceGreedy: `decode_chained()` is
    decode() of the last launched pass's rows (decode, decode_next or decode_chained) one token
    further, each row fed the token that pass samples on the device, before the host has read
    it: the device runs the two passes back to back. Called right after launching a pass whose
    rows were one device-greedy token each, all asking for logits (a backend may also chain to a
    pass whose chunks each asked for one output, as a draft model's catch-up does); raises
    ValueError otherwise. A pass's wait is called before sampled_tokens() reads its tokens; the engine
    waits for a chained pass it does not use and removes its cells (seq_remove)."""

    def decode_chained(self) -> Callable[[], np.ndarray]: ...


@runtime_checkable
class DeviceTokens(Protocol):
    """Optional LoadedModel capability, with DecodeChained: `launched_tokens()` is a handle to the
    tokens the last launched pass samples on the device (one per output row, in row order), taken
    before its wait, and decode() accepts chunks whose `device_tokens` name such handles (of this
    model or another of the same backend): the pass is fed with them on the device, so a draft
    model's rounds and the pass that verifies them run back to back with one wait."""

    feeds_device_tokens: bool

    def launched_tokens(self) -> Any: ...


@runtime_checkable
class Reproducible(Protocol):
    """Optional LoadedModel capability: `reproducible()` says whether this load computes a
    sequence's logits bit for bit the same whatever other sequences share its passes, however its
    prompt is cut into passes and however many rows of it a pass holds (drafts), and why, in a
    sentence for the user. The engine's replies then depend on the request alone. A model
    without it is reported as not promising it."""

    def reproducible(self) -> tuple[bool, str]: ...


@runtime_checkable
class ShiftsCells(Protocol):
    """Optional LoadedModel capability: `seq_shift(seq, start, end, delta)` moves the cells of
    sequence `seq` at positions [start, end) by `delta` positions (llama.cpp's
    llama_memory_seq_add: keys are rotated to their new position), where `can_shift()` says the
    load can (not every architecture and cache can). The prefix pool uses it for the requests that
    ask to reuse cached chunks that moved (options.cacheReuse). A shifted cell holds other numbers
    than computing it at its new position would (its keys rotated twice, and computed after
    other tokens than those now before it): the pool never gives shifted cells to a request that
    did not ask for them."""

    def can_shift(self) -> bool: ...

    def seq_shift(self, seq: int, start: int, end: int, delta: int) -> None: ...


@attrs.frozen(eq=False)
class Media:
    """An image in a prompt: it takes `length` positions of the prompt from index `start` (the
    prompt's token list holds placeholders there), `key` is its content's hash, `handle` the
    backend's own form of it (its tokenized chunk)."""

    start: int
    length: int
    key: str
    handle: Any = None


@runtime_checkable
class Vision(Protocol):
    """Optional LoadedModel capability: images in prompts, where `vision` is true (a model loaded
    with its projector).

    `media_prompt(pieces, add_special)` tokenizes a prompt of text pieces (str) and images (the
    bytes of a PNG, JPEG, ... file) into its token list, with placeholders where the images go,
    and each image's Media; any thread; ValueError for an image it cannot read.
    `eval_media(seq, media, pos)` puts an image's embeddings into sequence `seq`'s cells from
    position `pos` (a pass, or several, of their own), on the engine thread; an image whose
    content was encoded before comes from a cache, not the encoder. `media_stats()`: how many
    images were encoded and how many came from that cache, since the load."""

    vision: bool

    def media_prompt(self, pieces: Sequence[str | bytes], add_special: bool) -> tuple[list[int], list[Media]]: ...

    def eval_media(self, seq: int, media: Media, pos: int) -> None: ...

    def media_stats(self) -> dict[str, int]: ...


# A model's fill-in-the-middle tokens: prefix, suffix, middle, pad, repository, file separator.
FIM_KEYS = ("pre", "suf", "mid", "pad", "rep", "sep")


@runtime_checkable
class FillInMiddle(Protocol):
    """Optional LoadedModel capability: `fim_tokens()` names the model's fill-in-the-middle
    tokens as its file declares them: a dict of some of "pre", "suf", "mid", "pad", "rep", "sep"
    (prefix, suffix, middle, pad, repository, file separator) to token ids. Without it the host
    looks for the usual spellings of those tokens in the vocabulary."""

    def fim_tokens(self) -> dict[str, int]: ...


# How a model pools its tokens' hidden states into one vector per input (llama.cpp's pooling types):
# the mean of every token's, the first token's (CLS), the last token's; "rank": a reranker, whose
# pooled state goes through a classification head to relevance scores.
POOLINGS = ("mean", "cls", "last", "rank")


@runtime_checkable
class Embeds(Protocol):
    """Optional LoadedModel capability: a model loaded to embed (or, `pooling` "rank", to score
    query-document pairs) rather than to generate: the host sends it no generation.

    `embed(token_lists)` runs on the engine's worker thread and returns a float32 array with one
    row per token list: its pooled vector (`pooling` "mean", "cls", "last"), or its relevance
    scores ("rank": the first column is the score). A row depends on its own tokens alone, never
    on the other lists of the call or of earlier calls: a vector index stays stable whatever else
    is embedded at the same time. Each list fits the model's `info.context_length`.
    `dimensions` are the sizes a vector may be cut to (Matryoshka), its full size among them,
    when the model says it was trained for it; empty: a vector is meaningful only whole.
    """

    pooling: str
    dimensions: tuple[int, ...]

    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray: ...


@runtime_checkable
class Reranks(Protocol):
    """Optional LoadedModel capability, with Embeds whose pooling is "rank": `pair_tokens(query,
    document)` is the token list of one pair as the reranker reads it (its own rerank template
    where the model has one), for `embed` to score."""

    def pair_tokens(self, query: str, document: str) -> list[int]: ...


class Backend(Protocol):
    """A way to run models (llama.cpp, MLX), registered by a plugin.

    `formats` lists the model formats it reads ("gguf", "mlx"). `load` is called on the engine
    thread; it reports progress in [0, 1] through `progress` and raises on failure with a
    message a user can act on. Optional: `weights`, the forms of LoadOptions.weights it can run
    (default ("quantized",): as stored; a load asking for another is refused before it starts).
    """

    name: str
    formats: tuple[str, ...]

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> LoadedModel: ...


@runtime_checkable
class WeightForms(Protocol):
    """Optional Backend capability: `weights`, the forms of LoadOptions.weights it can run
    ("quantized": as stored, "dense": expanded to floats at load). Without it: ("quantized",)."""

    weights: tuple[str, ...]


@runtime_checkable
class BackendFeatures(Protocol):
    """Optional Backend capability: `features()` says, cheaply (without loading anything heavy),
    what this install of the backend can do beyond the contract, e.g. {"rpc": True}; it is
    `initialize`'s `capabilities.backendFeatures[name]`."""

    def features(self) -> dict[str, Any]: ...


@runtime_checkable
class MachineAware(Protocol):
    """Optional Backend capability: `machine()` reports the devices' and host's free memory, so
    that placements can decide what goes where (llama). Without it the backend places models
    itself and placements do not apply."""

    def machine(self) -> MachineInfo: ...


class DraftPolicy(Protocol):
    """Proposes draft tokens for speculative decoding: a unique `name` and exactly one of

    - `propose(history, k)` (Proposes): a request's prompt + reply tokens so far -> at most k
      draft tokens, depending only on that request's own history, so that a reply never depends
      on its neighbours;
    - `session(target, backend, options)` (SessionPolicy), for a policy that needs state per
      load (a draft model, the target's MTP head): a DraftSession, which the engine makes once
      per load on its worker thread (at load time when it is the load's default policy) and asks
      for every drafting request of a step at once.
    """

    name: str


@runtime_checkable
class Proposes(Protocol):
    """A DraftPolicy that drafts from one request's history alone: `propose(history, k)`."""

    name: str

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...


@attrs.frozen
class DraftRequest:
    """One request's part of a step's drafting: its sequence (slot) id, history, draft count."""

    seq: int
    history: Sequence[int]
    k: int


class DraftSession(Protocol):
    """A draft policy's state for one load, used only from the engine's worker thread.

    `propose_many(requests)` returns, for each request in order, at most `k` draft tokens that
    depend only on that request's history. The sequence id is the slot the request runs in now;
    a slot is reused by later requests and a request may move to another slot, so a session
    that keeps per-sequence state must check it against the history it is given. `close()`
    frees what the session holds (called before the target model closes).
    """

    def propose_many(self, requests: Sequence[DraftRequest]) -> list[list[int]]: ...

    def close(self) -> None: ...


class PendingDrafts(Protocol):
    """Drafts launched on the device and not read yet (DeviceDraftSession). `handles[i]` is
    request i's `SeqChunk.device_tokens` (its drafts on the device; the chunk takes the first k),
    or `handles` is None when the drafts were read already. `resolve()` returns the drafts as
    propose_many would, once the pass they were fed to has been waited for (no wait of its own
    then), and settles the session's state; it is called exactly once."""

    handles: Sequence[tuple[Sequence[Any], int]] | None

    def resolve(self) -> list[list[int]]: ...


@runtime_checkable
class DeviceDraftSession(Protocol):
    """Optional DraftSession capability: `propose_on_device(requests)` is propose_many whose
    drafts stay on the device for the target's verify pass to be fed with (a DeviceTokens target
    of the same backend), or None when it cannot this step (then propose_many)."""

    def propose_on_device(self, requests: Sequence[DraftRequest]) -> PendingDrafts | None: ...


@runtime_checkable
class SessionPolicy(Protocol):
    """Optional DraftPolicy capability: state per load (a draft model, the target's MTP head).
    `session(target, backend, options)` returns the load's DraftSession."""

    name: str

    def session(self, target: LoadedModel, backend: Backend, options: LoadOptions) -> DraftSession: ...


@attrs.frozen
class GpuInfo:
    """One GPU as the backend sees it: its name (llama.cpp's "CUDA0", ...) and memory."""

    name: str
    free_bytes: int = 0
    total_bytes: int = 0


@attrs.frozen
class MachineInfo:
    """What a placement may know of the machine.

    `gpus` lists each GPU in the backend's device order (the order of `LoadOptions.tensor_split`
    and the index of `main_gpu`); `gpu_free_bytes` and `gpu_total_bytes` are their sums (a
    backend that does not list its GPUs gives only the sums). `of_gpus` makes both agree.
    """

    gpu_free_bytes: int = 0
    gpu_total_bytes: int = 0
    host_free_bytes: int = 0
    has_gpu: bool = False
    gpus: tuple[GpuInfo, ...] = ()

    @classmethod
    def of_gpus(cls, gpus: Iterable[GpuInfo], host_free_bytes: int = 0) -> MachineInfo:
        """A machine with these GPUs, their sums filled in."""
        listed = tuple(gpus)
        return cls(
            gpu_free_bytes=sum(g.free_bytes for g in listed),
            gpu_total_bytes=sum(g.total_bytes for g in listed),
            host_free_bytes=host_free_bytes,
            has_gpu=bool(listed),
            gpus=listed,
        )

    @staticmethod
    def host_available() -> int:
        """Bytes of host memory available now (Linux's MemAvailable, else the free pages), 0 if
        unknown: for backends filling in `host_free_bytes`."""
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0


@attrs.frozen
class ModelFacts:
    """What a placement may know of a model before loading it (from its file's metadata).

    Byte counts are of the weights as stored: `weight_bytes` all of them, `expert_bytes` the
    mixture-of-experts tensors (`ffn_*_exps`), `outside_bytes` those outside the repeating layers
    (embeddings, output). `kv_bytes_per_cell` is one KV cell across all layers at f16.
    """

    path: str
    size_bytes: int
    layers: int = 0
    experts: int = 0
    architecture: str = ""
    experts_used: int = 0
    weight_bytes: int = 0
    expert_bytes: int = 0
    outside_bytes: int = 0
    n_embd: int = 0
    n_vocab: int = 0
    n_ff: int = 0
    kv_bytes_per_cell: int = 0


@attrs.frozen
class PlacementPlan:
    """A placement's decision: GPU layers, tensors kept in host memory, pass size, and why.

    `batch` / `ubatch` (None: the defaults) are the logical and physical pass sizes; with tensors
    in host memory every physical pass rereads them, so a placement that keeps experts there asks
    for large ones. With several GPUs, `split_mode`, `tensor_split` and `main_gpu` say how the
    offloaded layers are spread over them (LoadOptions' fields of those names; None / empty: not
    set, the backend's default). The load options a user set explicitly win over the plan.
    """

    gpu_layers: int
    host_tensors: tuple[str, ...] = ()
    batch: int | None = None
    reason: str = ""
    ubatch: int | None = None
    split_mode: str | None = None
    tensor_split: tuple[float, ...] = ()
    main_gpu: int | None = None


class Placement(Protocol):
    """Decides what lives in GPU memory and what in host memory for one load.

    `plan(model, machine, options)` returns a PlacementPlan or raises ValueError whose message
    says what would fit.
    """

    name: str

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan: ...


# What each kind of plugin object must have, and the optional capabilities it may have: a
# capability is all of its protocol's members or none of them.
CONTRACTS: dict[str, tuple[type, tuple[type, ...]]] = {
    "backend": (Backend, (WeightForms, MachineAware, BackendFeatures)),
    "draft policy": (DraftPolicy, (Proposes, SessionPolicy)),
    "placement": (Placement, ()),
    "model": (
        LoadedModel,
        (
            DeviceGreedy,
            DeviceArgmax,
            AsyncDecode,
            DecodeNext,
            DecodeChained,
            DeviceTokens,
            Reproducible,
            ShiftsCells,
            FillInMiddle,
            Embeds,
            Reranks,
            Vision,
        ),
    ),
}


# Kinds whose objects must have exactly one of these capabilities, whole.
ONE_OF: dict[str, tuple[type, ...]] = {"draft policy": (Proposes, SessionPolicy)}


def members(protocol: type) -> tuple[str, ...]:
    """The attributes and methods a protocol declares."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return tuple(sorted(names))


def contract_problems(obj: object, kind: str) -> list[str]:
    """What is wrong with `obj` as a `kind` (a key of CONTRACTS): required members it lacks,
    optional capabilities it has only in part, and public attributes that look like misspellings
    of a member it lacks (a misspelt optional member would otherwise turn a feature off silently).
    Empty when it is sound."""
    required, optional = CONTRACTS[kind]
    problems = []
    own = members(required)
    missing = [m for m in own if not hasattr(obj, m)]
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    known = set(own)
    for capability in optional:
        names = [n for n in members(capability) if n not in own]  # the capability's own members
        known.update(names)
        have = [n for n in names if hasattr(obj, n)]
        if have and len(have) < len(names):
            lacking = ", ".join(n for n in names if n not in have)
            problems.append(f"has {', '.join(have)} but not {lacking} ({capability.__name__} needs all of them)")
    choices = ONE_OF.get(kind, ())
    whole = [c for c in choices if all(hasattr(obj, n) for n in members(c))]
    if choices and len(whole) != 1:
        named = " or ".join(f"{', '.join(n for n in members(c) if n not in own)} ({c.__name__})" for c in choices)
        problems.append(f"needs exactly one of {named}, has {len(whole)}")
    absent = sorted(n for n in known if not hasattr(obj, n))
    for attr in dir(obj):
        if attr.startswith("_") or attr in known:
            continue
        close = difflib.get_close_matches(attr, absent, n=1, cutoff=0.85)
        if close:
            problems.append(f"has {attr!r}, not {close[0]!r}: misspelt?")
    return problems
