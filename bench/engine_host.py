"""The engine's host time per decode step, without a device: what the GPU waits for.

    python bench/engine_host.py [--npl 32,64,128] [--vocab 32000] [--steps 200]

On the GPU a step is: the backend's decode() call (llama_decode queues the pass), the wait for
the pass, then the engine's host work (the argmax over every row's logits, taking the tokens,
planning the next pass), during which the device is idle. This drives the real engine with a
stand-in model whose passes are instant and whose logits are a fixed array of the real shape, so
each step's time is only that host work (plus the text work, which on a device overlaps the pass:
it is timed apart). --model picks stand-ins for the llama backend without the argmax patch
(host), with it (device), and with decode_next too (device-next). Not evidence that anything
decodes: bench/compare.py measures that.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from harness import PhaseTimer, emit

from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.types import ModelInfo


class InstantModel:
    """Passes take no time; every row's logits are rows of one fixed random array. It stands
    in for a GPU, whose decode() returns before the pass is done (so the engine starts passes
    ahead, as there)."""

    decode_async = True

    def __init__(self, slots: int, vocab: int, context: int):
        self.info = ModelInfo(
            name="instant", path="", backend="none", n_vocab=vocab, context_length=context, slots=slots
        )
        rng = np.random.default_rng(0)
        self.logits = rng.standard_normal((slots, vocab), dtype=np.float32)

    def decode(self, chunks):
        n = sum(c.outputs for c in chunks)
        return lambda: self.logits[:n]

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [1] * len(text)

    def token_bytes(self, token: int) -> bytes:
        return b"x"

    def eog_tokens(self):
        return ()

    def chat_template(self):
        return None

    def seq_remove(self, seq, start=0, end=-1):
        pass

    def seq_copy(self, src, dst, start=0, end=-1):
        pass

    def memory(self):
        return {}

    def close(self):
        pass


class DeviceArgmaxModel(InstantModel):
    """As the llama backend with llama.cpp patched: the pass takes greedy rows' argmax and
    copies back token ids (sampled_tokens), no logits."""

    device_greedy = True

    def decode(self, chunks):
        self.n = sum(c.outputs for c in chunks)
        return lambda: self.logits[: self.n]

    def set_device_greedy(self, seq, on):
        return True

    def sampled_tokens(self):
        return [7] * self.n


class DeviceArgmaxNextModel(DeviceArgmaxModel):
    """... and decode_next: the last pass's rows one token further, with no chunks to read."""

    def decode_next(self, tokens):
        return lambda: self.logits[: self.n]


MODELS = {"host": InstantModel, "device": DeviceArgmaxModel, "device-next": DeviceArgmaxNextModel}


def run(npl: int, vocab: int, steps: int, kind: str = "host") -> dict:
    model = MODELS[kind](npl, vocab, steps + 64)
    engine = Engine(lambda p: model, lambda fn: fn(), batch=2048, prefix=-1)
    engine.load_model()
    options = GenerateOptions(max_tokens=steps + 8, ignore_eos=True, sampling=SamplingOptions(temperature=0.0))
    for i in range(npl):
        engine.submit(Job([1 + i, 2, 3, 4], options, on_piece=lambda text, toks: None))
    engine.step()  # the prompts
    for _ in range(10):
        engine.step()
    timer = PhaseTimer(engine)
    for _ in range(steps):
        engine.step()
    ms = timer.summary()
    engine.stop()
    host = ms["ms_step"] - ms["ms_text"]
    return {
        "model": kind,
        "npl": npl,
        "vocab": vocab,
        "ms_step_host": round(host, 3),
        "ms_argmax": ms["ms_argmax"],
        "ms_plan": ms["ms_plan"],
        "ms_rest": round(host - ms["ms_argmax"] - ms["ms_plan"], 3),
        "ms_text_overlapped": ms["ms_text"],
        "ms_gap_device_idle": ms["ms_gap"],
        "cpus": os.cpu_count(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npl", default="32,64,128")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--model",
        default="host,device,device-next",
        help="stand-ins: host (the engine takes the argmax), device (the pass takes it), "
        "device-next (and the backend has decode_next)",
    )
    args = ap.parse_args()
    for n in [int(x) for x in args.npl.split(",")]:
        for kind in args.model.split(","):
            emit("host", run(n, args.vocab, args.steps, kind))


if __name__ == "__main__":
    main()
