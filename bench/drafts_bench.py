"""Speculative decoding: tok/s with and without a draft policy, on an edit and a chat workload,
and the cost of one pass checking k drafts (the curve of step time over k).

    python bench/drafts_bench.py [MODEL.gguf] [--drafts 4,8] [--draft-model DRAFT.gguf] [--curve MODEL.gguf]
    python bench/drafts_bench.py MLX_FOLDER --backend mlx [--drafts 4,13] [--draft-model DRAFT_FOLDER]

On mlx the draft model runs twice: as the engine runs it (its drafts fed to the checking pass on
the device, one wait a step) and as draft-model-read-first (the drafts read on the host first).

Edit: a code file in the prompt and the request to return it with a small change (editors and
agents rewrite text they were given). Chat: an open question. Greedy, one request at a time,
through the engine on its worker thread. Replies are compared token for token with drafting off.
"""

from __future__ import annotations

import argparse
import os
import time

import attrs
from harness import emit, run_one, start_engine

from kinfer_rpc.default_plugins.drafts import DraftModelPolicy, NgramPolicy
from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine.job import GenerateOptions, Job, Outcome
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.host import templates as chat
from kinfer_rpc.host.requests import reply_of
from kinfer_rpc.protocol.results import reply_json
from kinfer_rpc.types import Backend, LoadOptions, SeqChunk

CODE = '''import math


def area(radius):
    """The area of a circle."""
    return math.pi * radius ** 2


def circumference(radius):
    """The circumference of a circle."""
    return 2 * math.pi * radius


def describe(radius):
    a = area(radius)
    c = circumference(radius)
    return f"radius {radius}: area {a:.2f}, circumference {c:.2f}"


if __name__ == "__main__":
    for r in (1, 2, 3):
        print(describe(r))
'''

WORKLOADS = {
    "edit": "Here is a Python file:\n\n```python\n" + CODE + "```\n\nReturn the whole file, unchanged except "
    "that the function `area` is renamed to `disc_area` everywhere.",
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def load(
    model: str,
    max_drafts: int,
    gpu_layers: int,
    threads: int | None,
    draft_model: str | None = None,
    backend_name: str = "llama",
) -> Engine:
    opts = LoadOptions(
        context_length=2048,
        slots=1,
        batch=2048,
        ubatch=512,
        threads=threads,
        gpu_layers=gpu_layers,
        drafts=max_drafts,
        draft_model=draft_model,
    )
    backend: Backend
    if backend_name == "mlx":
        from kinfer_rpc.default_plugins.mlx import MlxBackend

        backend = MlxBackend()
    else:
        backend = LlamaBackend()
    return start_engine(
        lambda p: backend.load(model, opts, p),
        draft_session=lambda policy, target: policy.session(target, backend, opts),
    )


class ReadFirst:
    """draft-model with its drafts read on the host before the pass that checks them (two waits
    a step): the reference for the drafts fed to that pass on the device (one wait a step)."""

    name = "draft-model-read-first"

    def propose(self, history, k):
        raise RuntimeError("drafts through a session")

    def session(self, target, backend, options):
        inner = DraftModelPolicy().session(target, backend, options)
        return _Eager(inner)


@attrs.define
class _Eager:
    inner: object

    def propose_many(self, requests):
        return self.inner.propose_many(requests)

    def close(self):
        self.inner.close()


def run(engine: Engine, prompt: list, options: GenerateOptions) -> Job:
    return run_one(engine, prompt, options).jobs[0]


def workloads(args):
    engine = load(args.model, max(args.drafts), args.gpu_layers, args.threads, args.draft_model, args.backend)
    policies = [NgramPolicy()] + ([DraftModelPolicy()] if args.draft_model else [])
    if args.draft_model and args.backend == "mlx":
        policies.append(ReadFirst())
    info = engine.model.info
    base = GenerateOptions(max_tokens=args.max_tokens, sampling=SamplingOptions(temperature=0.0))
    for name, text in WORKLOADS.items():
        rendered = chat.render(
            engine.template, [{"role": "user", "content": text}], bos=info.bos_text, eos=info.eos_text
        )
        prompt = engine.model.tokenize(rendered, False, True)
        # Every measured run comes after a short one of the same prompt and options, so that no
        # row pays for first use (a draft model's load, MLX compiling a new pass shape).
        warm = min(args.max_tokens, 32)
        run(engine, prompt, attrs.evolve(base, max_tokens=warm))
        plain = run(engine, prompt, base)
        plain_tps = reply_json(reply_of(Outcome.of(plain)))["timings"]["tokensPerSecond"]
        emit(
            "workload",
            {"workload": name, "policy": "none", "drafts": 0, "tokens": len(plain.generated), "tps": plain_tps},
        )
        for policy, k in [(p, k) for p in policies for k in args.drafts]:
            options = attrs.evolve(base, drafts=k, draft_policy=policy)
            run(engine, prompt, attrs.evolve(options, max_tokens=warm))
            job = run(engine, prompt, options)
            r = reply_json(reply_of(Outcome.of(job)))
            u = r["usage"]
            emit(
                "workload",
                {
                    "workload": name,
                    "policy": policy.name,
                    "drafts": k,
                    "tokens": len(job.generated),
                    "tps": r["timings"]["tokensPerSecond"],
                    "speedup": round(r["timings"]["tokensPerSecond"] / plain_tps, 3) if plain_tps else None,
                    "acceptance": round(u["draftAccepted"] / u["draftTokens"], 3) if u["draftTokens"] else 0.0,
                    "same_reply": job.generated == plain.generated,
                },
            )
    engine.stop()


def curve(args):
    """Step time of one pass over 1 + k positions of one sequence, k = 0..16."""
    opts = LoadOptions(
        context_length=4096,
        slots=1,
        batch=2048,
        ubatch=512,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
        drafts=16,
    )
    model = LlamaBackend().load(args.curve, opts, lambda f: None)
    prompt = [(17 * i) % (model.info.n_vocab - 10) + 5 for i in range(256)]
    model.decode([SeqChunk(0, 0, prompt, 1)])()
    base = None
    for k in range(0, 17):
        times = []
        for _rep in range(args.reps):
            pos = len(prompt)
            t = time.perf_counter()
            model.decode([SeqChunk(0, pos, prompt[: k + 1], k + 1)])()
            times.append(time.perf_counter() - t)
            model.seq_remove(0, pos, -1)
        ms = sorted(times)[len(times) // 2] * 1000
        base = base or ms
        emit(
            "curve",
            {"model": os.path.basename(args.curve), "k": k, "step_ms": round(ms, 3), "vs_k0": round(ms / base, 3)},
        )
    model.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--drafts", default="4,8")
    ap.add_argument("--draft-model", default=None, help="also the draft-model policy with this model")
    ap.add_argument("--backend", choices=["llama", "mlx"], default="llama", help="the workloads' backend")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--curve", default=None, help="a model to measure the k-curve on")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.drafts = [int(x) for x in args.drafts.split(",")]
    if args.model is None and args.curve is None:
        from kinfer_rpc.host.store import embedded_default_path

        args.model = embedded_default_path()
    if args.model:
        workloads(args)
    if args.curve:
        curve(args)


if __name__ == "__main__":
    main()
