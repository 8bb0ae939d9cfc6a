"""kinfer-markov: a complete kinfer-rpc plugin in one module, docs/plugins.md's worked example.

- backend `markov`: a byte-level bigram model counted from a text file at load. It really generates.
- draft policy `markov-repeat`: drafts what followed the last token when it last occurred.
- placement `markov-cpu`: keeps every layer in host memory; refuses what the host cannot hold.

A markov model is a folder holding `config.json` (`{"model_type": "markov"}`) and `corpus.txt`.
tests/test_plugin_examples.py installs this package with pip and runs it through `kinfer-rpc`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

import kinfer_rpc
from kinfer_rpc.types import LoadOptions, MachineInfo, ModelFacts, ModelInfo, PlacementPlan, SeqChunk

EOG = 256  # the end-of-generation token; tokens 0..255 are the bytes themselves
N_VOCAB = 257
# Jinja, rendered by the server for inference/chat: each message's text on its own line.
TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


class MarkovModel:
    """A loaded bigram model (kinfer_rpc.types.LoadedModel).

    Token t < 256 is the byte t; 256 ends generation. The logits of a row are the log-probabilities
    of the next token given the row's own token alone, counted from the corpus; the corpus's end
    counts as the end-of-generation token following its last byte, and a byte never followed by
    anything is followed by the end of generation.
    """

    def __init__(self, path: str, options: LoadOptions, progress: Callable[[float], None]):
        config_path = os.path.join(path, "config.json")
        with open(config_path) as fh:
            model_type = json.load(fh).get("model_type")
        if model_type != "markov":
            raise ValueError(
                f"{config_path} has model_type {model_type!r}, not 'markov': the markov backend reads a "
                'folder with config.json {"model_type": "markov"} and corpus.txt; load others with their own backend'
            )
        with open(os.path.join(path, "corpus.txt"), "rb") as fh:
            corpus = np.frombuffer(fh.read(), dtype=np.uint8).astype(np.intp)
        progress(0.5)
        counts = np.zeros((N_VOCAB, N_VOCAB))
        np.add.at(counts, (corpus[:-1], corpus[1:]), 1)
        if len(corpus):
            counts[corpus[-1], EOG] += 1
        counts[counts.sum(axis=1) == 0, EOG] = 1
        with np.errstate(divide="ignore"):  # log(0) is -inf: a token that never follows
            self._log_probs = np.log(counts / counts.sum(axis=1, keepdims=True)).astype(np.float32)
        self.info = ModelInfo(
            name=os.path.basename(os.path.normpath(path)),
            path=path,
            backend="markov",
            n_vocab=N_VOCAB,
            context_length=options.context_length,
            slots=options.slots,
            architecture="markov",
            parameters=N_VOCAB * N_VOCAB,
            size_bytes=int(corpus.size),
            description=f"byte bigrams counted from {corpus.size} bytes",
            # A pass costs the same whatever its rows: 4 drafts when the load leaves it to us.
            drafts=4 if options.drafts is None else options.drafts,
        )
        progress(1.0)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """The UTF-8 bytes of `text`: no BOS, and no text spells a special token."""
        return list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        """The byte of a byte token; the end-of-generation token has no text."""
        return bytes((token,)) if token < EOG else b""

    def eog_tokens(self) -> Iterable[int]:
        """Only token 256 ends generation."""
        return (EOG,)

    def chat_template(self) -> str | None:
        """A tiny Jinja template (None would make the server fall back to ChatML)."""
        return TEMPLATE

    def decode(self, chunks: Sequence[SeqChunk]) -> Callable[[], np.ndarray]:
        """One pass: for each chunk's last `outputs` tokens, in chunk order, that token's row."""
        rows = [t for c in chunks for t in c.tokens[len(c.tokens) - c.outputs :]]
        logits = self._log_probs[rows]  # (sum of outputs, 257) float32; computed now, so the wait just returns it
        return lambda: logits

    # A bigram's logits depend only on the row's own token, never on the cells before it: there
    # is no per-sequence state (no KV cache) to drop or copy, so these two are no-ops.
    def seq_remove(self, seq: int, start: int = 0, end: int = -1) -> None:
        """Nothing to drop: see the comment above."""

    def seq_copy(self, src: int, dst: int, start: int = 0, end: int = -1) -> None:
        """Nothing to copy: see the comment above."""

    def memory(self) -> dict:
        """What model/status reports: the bigram table's bytes, in host memory."""
        return {"modelBytes": int(self._log_probs.nbytes), "device": "cpu"}

    def close(self) -> None:
        """Let go of the table."""
        self._log_probs = np.zeros((0, N_VOCAB), np.float32)


class MarkovBackend:
    """`markov` (kinfer_rpc.types.Backend): loads a markov model folder as a MarkovModel.

    The model store calls every folder with a config.json format "mlx" (it names no other folder
    format), so this backend lists "mlx" second, after its own name: the mlx backend, which lists
    "mlx" first, keeps MLX folders, and a markov model is loaded with
    `model/load {"model": PATH, "backend": "markov"}`. Without the mlx backend, an MLX folder
    loaded without "backend" comes here and is refused with the reason.
    """

    name = "markov"
    formats = ("markov", "mlx")

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> MarkovModel:
        """Read the folder and count its bigrams (milliseconds for a megabyte)."""
        return MarkovModel(path, options, progress)


class RepeatDraft:
    """`markov-repeat` (kinfer_rpc.types.DraftPolicy): drafts the up to k tokens that followed the
    last token the previous time it occurred in the history, a bigram guess from the request's own
    tokens. It reads nothing but `history`, so a request's drafts never depend on its neighbours.
    """

    name = "markov-repeat"

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """At most k draft tokens; none when the last token has not occurred before."""
        if k <= 0 or not history:
            return []
        last = history[-1]
        for i in range(len(history) - 2, max(-1, len(history) - 1026), -1):  # the last 1024 tokens
            if history[i] == last:
                return list(history[i + 1 : i + 1 + k])
        return []


class CpuOnly:
    """`markov-cpu` (kinfer_rpc.types.Placement): every layer in host memory, for a model the
    host can hold next to its KV cache; raises ValueError saying what would fit otherwise."""

    name = "markov-cpu"

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan:
        """A plan with gpu_layers 0, or ValueError when weights and KV cache exceed free host memory."""
        kv = model.kv_bytes_per_cell * options.context_length * options.slots
        free = machine.host_free_bytes  # 0: unknown, and then nothing is refused
        if free and model.size_bytes + kv > free:
            raise ValueError(
                f"{os.path.basename(model.path)} needs {model.size_bytes} bytes of weights and {kv} of KV cache "
                f"({options.slots} slots x {options.context_length}) in host memory but {free} are free: "
                f"fewer slots, a shorter context, or a model under {max(free - kv, 0)} bytes would fit"
            )
        layers = f"all {model.layers} layers" if model.layers else "every layer"
        return PlacementPlan(
            gpu_layers=0, reason=f"markov-cpu: {layers} in host memory ({model.size_bytes + kv} bytes)"
        )


@kinfer_rpc.hookimpl
def register_backends(register):
    """The markov backend."""
    register(MarkovBackend())


@kinfer_rpc.hookimpl
def register_draft_policies(register):
    """The markov-repeat draft policy."""
    register(RepeatDraft())


@kinfer_rpc.hookimpl
def register_placements(register):
    """The markov-cpu placement."""
    register(CpuOnly())
