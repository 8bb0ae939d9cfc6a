"""Is llama.cpp's CUDA backend batch-invariant? A standalone probe over llama-cpp-python's low-level API.

    python bench/cuda_invariance.py MODEL.gguf [--others 1,7,31,127] [--steps 64] [--prompt 100]

Sequence 0 (a random prompt of --prompt tokens, then --steps greedy tokens) is decoded alone, as kinfer
does it: one context, one KV stream per sequence (kv_unified off), flash attention on, f16 KV cells,
n_batch 4096 / n_ubatch 512, every layer on the GPU. Then again: among N other sequences (prompts of
different lengths, arriving at different steps, each decoding greedily), with its prompt cut into
passes (7 + the rest; 16 at a time), and with its first 64 prompt tokens computed by sequence 1 and
copied over (a reused prefix). Each case prints one JSON line comparing sequence 0's logits rows
(bit for bit, and the largest absolute difference) and its tokens with the lone run; a summary line
ends. Exit code 0 whatever differs: it is a measurement. GGML_CUDA_BATCH_INVARIANT=0|1 in the
environment picks the kernels of patches/llama-cuda-batch-invariant.patch; LLAMA_CPP_LIB_PATH the library.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kinfer_rpc.default_plugins.llama import native as llama_native

# llama.cpp through kinfer's loader: the libraries beside LLAMA_CPP_LIB_PATH's libllama, refused
# (not crashed) when they carry their own C++ runtime and numpy's is already loaded.
L = llama_native.load()

PER_SEQ = 512  # KV cells per sequence (one stream each)
N_BATCH = 4096
N_UBATCH = 512


@dataclass
class Seq:
    """One sequence's plan and state: its prompt fed in `chunks` from step `start`, then greedy tokens."""

    prompt: list[int]
    start: int
    chunks: list[int]
    pos: int = 0
    fed: int = 0  # prompt tokens fed so far
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


@dataclass
class Result:
    tokens: list[int]
    logits: list[np.ndarray]
    seconds: float


def _log_filter(_level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
    """Drop llama.cpp's log, but show ggml-cuda's batch-invariant line (which kernels ran)."""
    if text and b"batch_invariant" in text:
        sys.stderr.write(text.decode("utf-8", "replace"))


class Probe:
    def __init__(self, path: str, seed: int, prompt_len: int, steps: int) -> None:
        L.llama_backend_init()
        self._log_cb = L.llama_log_callback(_log_filter)
        L.llama_log_set(self._log_cb, ctypes.c_void_p())
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 99
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model)))
        self.rng = np.random.default_rng(seed)
        self.steps = steps
        self.prompt0 = self.random_prompt(prompt_len)
        # the other sequences' prompts and arrival steps, the same for every case
        self.other_prompts = [self.random_prompt(int(n)) for n in self.rng.integers(8, 200, size=127)]
        self.other_starts = [int(a) for a in self.rng.integers(0, max(1, steps * 3 // 4), size=127)]

    def random_prompt(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(100, self.n_vocab - 100, size=n)]

    def context(self, n_seq: int) -> L.llama_context_p:
        cparams = L.llama_context_default_params()
        cparams.n_seq_max = n_seq
        cparams.n_ctx = PER_SEQ * n_seq
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_UBATCH
        cparams.kv_unified = False
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = L.GGML_TYPE_F16
        cparams.n_threads = cparams.n_threads_batch = 4
        ctx: L.llama_context_p = L.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise SystemExit(f"llama.cpp could not create a context for {n_seq} sequences")
        return ctx

    def run(self, others: int = 0, chunks: list[int] | None = None, prefix: int = 0) -> Result:
        """Sequence 0 among `others` others, its prompt fed in `chunks` (None: at once); with `prefix` > 0 its
        first `prefix` prompt tokens are computed by sequence 1 and copied to sequence 0 beforehand."""
        remaining = len(self.prompt0) - prefix
        plan: list[int] = []
        for c in chunks or []:
            if 0 < c < remaining:
                plan.append(c)
                remaining -= c
        plan.append(remaining)
        seqs = {0: Seq(self.prompt0, 0, plan, pos=prefix, fed=prefix)}
        for i in range(others):
            p = self.other_prompts[i]
            seqs[i + 1] = Seq(p, self.other_starts[i], [len(p)])
        n_seq = max(len(seqs), 2 if prefix else 1)
        ctx = self.context(n_seq)
        batch = L.llama_batch_init(N_BATCH, 0, 1)
        t0 = time.perf_counter()
        try:
            if prefix:
                self.decode(ctx, batch, [(1, t, j, j == prefix - 1) for j, t in enumerate(self.prompt0[:prefix])])
                L.llama_memory_seq_cp(L.llama_get_memory(ctx), 1, 0, -1, -1)
            step = 0
            while len(seqs[0].tokens) < self.steps:
                rows: list[tuple[int, int, int, bool]] = []
                for s, q in seqs.items():
                    if step < q.start or len(q.tokens) >= self.steps:
                        continue
                    if q.chunks:
                        n = q.chunks.pop(0)
                        last = not q.chunks
                        part = q.prompt[q.fed : q.fed + n]
                        rows += [(s, t, q.pos + j, last and j == n - 1) for j, t in enumerate(part)]
                        q.fed += n
                        q.pos += n
                    elif q.tokens:
                        rows.append((s, q.tokens[-1], q.pos, True))
                        q.pos += 1
                for s, logits in self.decode(ctx, batch, rows):
                    seqs[s].tokens.append(int(logits.argmax()))
                    if s == 0:
                        seqs[s].logits.append(logits)
                step += 1
            L.llama_synchronize(ctx)
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
        return Result(seqs[0].tokens, seqs[0].logits, time.perf_counter() - t0)

    def decode(
        self, ctx: L.llama_context_p, batch: L.llama_batch, rows: list[tuple[int, int, int, bool]]
    ) -> list[tuple[int, np.ndarray]]:
        """One llama_decode of rows (seq, token, pos, wants logits); the logits rows asked for, as copies."""
        assert 0 < len(rows) <= N_BATCH, len(rows)
        batch.n_tokens = len(rows)
        for r, (s, t, p, want) in enumerate(rows):
            batch.token[r] = t
            batch.pos[r] = p  # type: ignore[call-overload]  # POINTER(llama_pos) takes an int
            batch.n_seq_id[r] = 1
            batch.seq_id[r][0] = s
            batch.logits[r] = want
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")
        out = []
        for r, (s, _t, _p, want) in enumerate(rows):
            if want:
                ptr = L.llama_get_logits_ith(ctx, r)
                out.append((s, np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()))
        return out


def compare(name: str, ref: Result, got: Result, **extra: object) -> dict[str, object]:
    """Sequence 0's tokens and logits rows against the lone run's, up to where their tokens part."""
    first_tok = next((i for i, (a, b) in enumerate(zip(ref.tokens, got.tokens)) if a != b), None)
    upto = len(ref.logits) if first_tok is None else first_tok + 1  # later rows have different inputs
    same_rows = [np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(ref.logits[:upto], got.logits)]
    diffs = [float(np.abs(a - b).max()) for a, b in zip(ref.logits[:upto], got.logits)]
    return {
        "case": name,
        **extra,
        "tokensSame": first_tok is None,
        "firstTokenDiff": first_tok,
        "logitRowsIdentical": sum(same_rows),
        "rowsCompared": len(same_rows),
        "firstLogitDiff": next((i for i, same in enumerate(same_rows) if not same), None),
        "maxAbsDiff": max(diffs, default=0.0),
        "seconds": round(got.seconds, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--others", default="1,7,31,127", help="comma-separated counts of other sequences (<= 127)")
    ap.add_argument("--steps", type=int, default=64, help="greedy tokens of sequence 0")
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens of sequence 0")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    others = [min(127, int(n)) for n in args.others.split(",") if n.strip()]
    probe = Probe(args.model, args.seed, args.prompt, args.steps)

    alone = probe.run()
    cases: list[tuple[str, dict[str, object], Result]] = [("alone again", {}, probe.run())]
    for n in others:
        cases.append((f"among {n} others", {"others": n}, probe.run(others=n)))
    cases.append(("prompt in 7 + rest", {"chunks": [7]}, probe.run(chunks=[7])))
    sixteens = [16] * (args.prompt // 16)
    cases.append(("prompt 16 at a time", {"chunks": 16}, probe.run(chunks=sixteens)))
    if others:
        n = others[min(2, len(others) - 1)]
        cases.append((f"prompt in 7 + rest among {n} others", {"chunks": [7], "others": n}, probe.run(n, [7])))
    prefix = min(64, args.prompt - 1)
    cases.append((f"first {prefix} prompt tokens reused", {"prefix": prefix}, probe.run(prefix=prefix)))

    identical = 0
    for name, extra, got in cases:
        row = compare(name, alone, got, **extra)
        identical += int(row["tokensSame"] is True and row["logitRowsIdentical"] == row["rowsCompared"])
        print(json.dumps(row), flush=True)
    summary = {
        "model": os.path.basename(args.model),
        "GGML_CUDA_BATCH_INVARIANT": os.environ.get("GGML_CUDA_BATCH_INVARIANT", "(unset)"),
        "aloneSeconds": round(alone.seconds, 3),
        "cases": len(cases),
        "bitIdentical": int(identical),
    }
    print(json.dumps({"summary": summary}), flush=True)
    L.llama_model_free(probe.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
