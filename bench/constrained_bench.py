"""What holding replies to a JSON schema costs: decode tok/s with every request constrained, as a
ratio of the same run unconstrained, and the time the grammar masks take per token.

    python bench/constrained_bench.py MODEL.gguf --npl 1,8,32 --ntg 128 [--gpu-layers 999]

For each N in --npl, N requests (distinct --npp-token prompts, greedy) generate --ntg tokens,
first unconstrained (ignoring end of generation, as llama-batched-bench does), then held to a
JSON schema that cannot be complete before --ntg tokens (an array of at least 1000 short
strings), so both runs decode the same number of tokens. Decode time is measured as in
bench/engine_bench.py (from the last request's first token to the last token). `mask_us_token`
is the time computing masks took per constrained token, `mask_share` that time as a share of
the decode time (masks are computed while the device runs the pass, so on a GPU they cost time
only where they outlast it). `choice_us_token` is the time choosing a greedy token under its mask
took (on the step's critical path), `own_best_share` how often the row's own best token was
allowed. Those four come from a third run, timed piece by piece; the ratio's run is not. Prints
one JSON object per line.
"""

from __future__ import annotations

import argparse
import time

from harness import Run, distinct_prompts, emit, greedy, start_engine

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine import grammar
from kinfer_rpc.types import LoadOptions

SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000},
    },
    "required": ["notes"],
}


class MaskClock:
    """Time spent in grammar.Masks.compute and grammar.one_mask, on any thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self.on = False
        compute, one = grammar.Masks.compute, grammar.one_mask

        def timed_compute(masks, matchers):
            if not self.on:
                return compute(masks, matchers)
            t = time.perf_counter()
            try:
                return compute(masks, matchers)
            finally:
                self.seconds += time.perf_counter() - t
                self.rows += len(matchers)

        def timed_one(matcher, n_vocab):
            if not self.on:
                return one(matcher, n_vocab)
            t = time.perf_counter()
            try:
                return one(matcher, n_vocab)
            finally:
                self.seconds += time.perf_counter() - t
                self.rows += 1

        grammar.Masks.compute = timed_compute  # type: ignore[method-assign]
        grammar.one_mask = timed_one


class ChoiceClock:
    """Time spent choosing greedy tokens under masks, on the step's critical path
    (grammar.Masks.choose for a pass of held rows, grammar.best_allowed for a row on its own),
    and how many of those rows the row's own best token settled."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self.own = 0
        self.on = False
        self.inside = False
        choose, choose_all = grammar.best_allowed, grammar.Masks.choose

        def timed(row, bits, *rest, **kw):
            if not self.on or self.inside:
                return choose(row, bits, *rest, **kw)
            t = time.perf_counter()
            token = choose(row, bits, *rest, **kw)
            self.seconds += time.perf_counter() - t
            self.rows += 1
            self.own += token is not None and token == int(row.argmax())
            return token

        def timed_all(masks, logits, picks, *rest):
            if not self.on:
                return choose_all(masks, logits, picks, *rest)
            own = masks.own_best
            self.inside = True
            t = time.perf_counter()
            try:
                return choose_all(masks, logits, picks, *rest)
            finally:
                self.seconds += time.perf_counter() - t
                self.inside = False
                self.rows += len(picks)
                self.own += masks.own_best - own

        grammar.best_allowed = timed
        grammar.Masks.choose = timed_all  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--npl", default="1,8,32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    args = ap.parse_args()
    npls = [int(x) for x in args.npl.split(",")]
    clock, choice = MaskClock(), ChoiceClock()
    opts = LoadOptions(
        context_length=args.npp + args.ntg + 8,
        slots=max(npls),
        batch=2048,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
    )
    engine = start_engine(lambda progress: LlamaBackend().load(args.model, opts, progress), prefix=-1)
    model = engine.model
    assert model is not None
    grammars = grammar.Grammars()
    t = time.perf_counter()
    grammars.tokenizer(model)
    emit("vocabulary", {"tokenizer_s": round(time.perf_counter() - t, 3), "n_vocab": model.info.n_vocab})

    def matcher():
        return grammars.matcher(model, "format", SCHEMA)

    Run(engine, distinct_prompts(1, 8, model.info.n_vocab), greedy(4))  # warm-up
    for npl in npls:
        prompts = distinct_prompts(npl, args.npp, model.info.n_vocab)
        plain = Run(engine, prompts, greedy(args.ntg)).timing()
        held = Run(engine, prompts, greedy(args.ntg), constraint=matcher)
        timed = held.timing()
        tokens = sum(len(r) for r in held.replies)
        assert all(len(r) == args.ntg for r in held.replies), "a constrained reply ended early"
        clock.seconds, clock.rows = 0.0, 0
        choice.seconds, choice.rows, choice.own = 0.0, 0, 0
        clock.on = choice.on = True
        pieces = Run(engine, prompts, greedy(args.ntg), constraint=matcher)
        clock.on = choice.on = False
        assert pieces.replies == held.replies, "the same requests gave other replies"
        emit(
            f"npl{npl}",
            {
                "npl": npl,
                "ntg": args.ntg,
                "plain_decode_tps": plain["decode_tps"],
                "schema_decode_tps": timed["decode_tps"],
                "ratio": round(timed["decode_tps"] / plain["decode_tps"], 3),
                "mask_us_token": round(clock.seconds / max(1, clock.rows) * 1e6, 1),
                "mask_share": round(clock.seconds / max(1e-9, pieces.timing()["decode_s"]), 3),
                "choice_us_token": round(choice.seconds / max(1, choice.rows) * 1e6, 1),
                "own_best_share": round(choice.own / max(1, choice.rows), 3),
                "tokens": tokens,
            },
        )
    engine.stop()


if __name__ == "__main__":
    main()
