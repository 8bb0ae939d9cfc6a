"""Built-in placements: what lives in GPU memory and what in host memory.

- `auto` (the default): everything on the GPU when it fits; else a mixture-of-experts model's
  expert tensors in host memory; else as many layers on the GPU as fit; with no GPU, the CPU.
- `gpu`: every layer on the GPU, or an error saying what would fit.
- `cpu`: everything in host memory.
- `experts-host`: every `ffn_*_exps` tensor in host memory, the rest on the GPU, prompt passes of
  4096 tokens (each pass rereads the experts from host memory: half as many passes, half as many
  reads).

With several GPUs (`MachineInfo.gpus`) each of them places what it places on "the GPU" on the
GPU with the most free memory when it fits there (split mode none: no traffic between GPUs), else
over all of them, each a range of layers in proportion to the memory it has free after its own
pass buffers and headroom (split mode layer, `tensor_split`); `auto` then falls back as with one
GPU: experts in host memory, then as many layers as the GPUs hold together, then the CPU.

Budgets are estimates from the GGUF header: the weights as stored, the KV cache (cells x bytes
per cell), and the compute buffer of the largest pass, which llama.cpp sizes for a pass whose
every row asks for logits (4 bytes x (vocabulary + activations) per row: 2-3 GiB for a 4096-row
pass of a 150k-vocabulary model), plus headroom for the device's own context.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import attrs

import kinfer_rpc
from kinfer_rpc.types import GpuInfo, LoadOptions, MachineInfo, ModelFacts, Placement, PlacementPlan

EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
HEADROOM = 768 << 20  # CUDA context, cuBLAS workspace, fragmentation
PASS_PLAIN = (2048, 512)  # logical, physical pass when every weight is on one side
PASS_EXPERTS = (4096, 4096)  # both large: the experts are copied over once per physical pass
_KV_FACTOR = {None: 1.0, "f16": 1.0, "q8_0": 34 / 64}


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


class Budget:
    """The memory one load needs, by side, for a given split."""

    def __init__(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions):
        self.m, self.machine, self.o = model, machine, options
        self.cells = options.context_length * options.slots
        factor = _KV_FACTOR.get(options.kv_type, 1.0)
        self.kv = int(model.kv_bytes_per_cell * factor * self.cells)
        layers = max(model.layers, 1)
        self.per_layer = max(model.weight_bytes - model.outside_bytes, 0) / layers
        self.per_layer_dense = max(model.weight_bytes - model.outside_bytes - model.expert_bytes, 0) / layers

    def compute(self, ubatch: int) -> int:
        m = self.m
        ff = m.experts_used * (m.n_ff or 0) if m.experts else m.n_ff
        return int(ubatch * 4 * (m.n_vocab + 6 * m.n_embd + 2 * ff))

    def reserve(self, ubatch: int) -> int:
        """What one GPU keeps besides weights and KV cache: its pass buffers and headroom."""
        return self.compute(ubatch) + HEADROOM

    def usable(self, ubatch: int) -> list[int]:
        """Each GPU's free memory less its own reserve: what its weights and KV cache may fill."""
        return [max(0, g.free_bytes - self.reserve(ubatch)) for g in self.machine.gpus]

    def free(self, ubatch: int) -> int:
        """The GPU memory a load may fill, one reserve included (as a need counts it): with
        several GPUs, what each has left after its own reserve, summed, plus one reserve."""
        if len(self.machine.gpus) < 2:
            return self.machine.gpu_free_bytes
        return sum(self.usable(ubatch)) + self.reserve(ubatch)

    def gpu_all(self, ubatch: int) -> int:
        return self.m.weight_bytes + self.kv + self.compute(ubatch) + HEADROOM

    def gpu_experts_host(self, ubatch: int) -> int:
        return self.m.weight_bytes - self.m.expert_bytes + self.kv + self.compute(ubatch) + HEADROOM

    def gpu_layers(self, n: int, ubatch: int) -> int:
        layers = max(self.m.layers, 1)
        return int(n * self.per_layer + self.kv * n / layers + self.compute(ubatch) + HEADROOM)

    def max_layers(self, ubatch: int) -> int:
        free = self.free(ubatch)
        n = self.m.layers
        while n > 0 and self.gpu_layers(n, ubatch) > free:
            n -= 1
        return n

    def max_context(self, fixed: int, free: int) -> int:
        """The largest context per slot whose KV cache fits in `free` next to `fixed` bytes."""
        per_cell = self.kv / self.cells if self.cells else 0
        if per_cell <= 0:
            return 0
        ctx = int((free - fixed) / (per_cell * self.o.slots))
        return max(0, ctx // 256 * 256)

    def describe(self, gpu_need: int, weights: int, ubatch: int) -> str:
        return (
            f"{gib(gpu_need)} of GPU memory (weights {gib(weights)}, KV cache {gib(self.kv)} for "
            f"{self.o.slots} slots x {self.o.context_length}, pass buffers {gib(self.compute(ubatch))})"
        )

    def check_host(self, host_bytes: int, what: str) -> None:
        free = self.machine.host_free_bytes
        if free and host_bytes > free:
            raise ValueError(
                f"{what} needs {gib(host_bytes)} of host memory but {gib(free)} is available; "
                f"free memory or choose a smaller model"
            )


def _cpu_plan(b: Budget, why: str) -> PlacementPlan:
    b.check_host(b.m.weight_bytes + b.kv, "keeping the model in host memory")
    return PlacementPlan(gpu_layers=0, batch=PASS_PLAIN[0], ubatch=PASS_PLAIN[1], reason=why)


def _gpu_alternatives(b: Budget) -> str:
    ways = []
    if b.m.experts and b.gpu_experts_host(PASS_EXPERTS[1]) <= b.free(PASS_EXPERTS[1]):
        ways.append(f"placement experts-host ({gib(b.gpu_experts_host(PASS_EXPERTS[1]))} on the GPU)")
    n = _max_split_layers(b, PASS_PLAIN[1]) if len(b.machine.gpus) >= 2 else b.max_layers(PASS_PLAIN[1])
    if 0 < n < b.m.layers:
        ways.append(f"gpuLayers {n} of {b.m.layers}")
    ctx = b.max_context(b.gpu_all(PASS_PLAIN[1]) - b.kv, b.free(PASS_PLAIN[1]))
    if ctx >= 256:
        ways.append(f"contextLength {ctx} with {b.o.slots} slots")
    ways.append("placement cpu")
    return "; would fit: " + ", ".join(ways)


class Split(NamedTuple):
    """How a load goes over several GPUs (PlacementPlan's fields of these names), and in words."""

    split_mode: str
    tensor_split: tuple[float, ...]
    main_gpu: int | None
    text: str


def _most_free(gpus: Sequence[GpuInfo]) -> int:
    """The GPU with the most free memory (the first of equals)."""
    return max(range(len(gpus)), key=lambda i: (gpus[i].free_bytes, -i))


def _shares(usable: Sequence[int]) -> tuple[float, ...]:
    total = sum(usable)
    return tuple(round(u / total, 4) for u in usable)


def layer_counts(shares: Sequence[float], act: int) -> list[int]:
    """How many of `act` offloaded layers llama.cpp gives each GPU for these shares: offloaded
    layer k goes to the first GPU whose cumulative share exceeds k / act (llama-model.cpp)."""
    total = sum(shares)
    bounds = list(itertools.accumulate(x / total for x in shares))
    counts = [0] * len(shares)
    for k in range(act):
        counts[min(bisect.bisect_right(bounds, k / act), len(shares) - 1)] += 1
    return counts


def _split_fits(b: Budget, act: int, ubatch: int, per_layer: float) -> bool:
    """Whether `act` offloaded layers (the output layer counted as one), split by layer in
    proportion to what each GPU has left, fit each GPU whole layer by whole layer."""
    usable = b.usable(ubatch)
    if not sum(usable):
        return False
    cost = per_layer + b.kv / max(b.m.layers, 1)
    return all(n * cost <= u for n, u in zip(layer_counts(_shares(usable), act), usable))


def _max_split_layers(b: Budget, ubatch: int) -> int:
    n = b.m.layers
    while n > 0 and not _split_fits(b, n, ubatch, b.per_layer):
        n -= 1
    return n


def _layer_split(b: Budget, ubatch: int) -> Split:
    """Each GPU a range of layers, in proportion to what it has left after its own reserve."""
    shares = _shares(b.usable(ubatch))
    return Split(
        "layer",
        shares,
        None,
        f"split by layer over {len(shares)} GPUs in proportion to the memory each has free after its pass "
        f"buffers (tensorSplit {', '.join(f'{x:g}' for x in shares)})",
    )


def _spread(b: Budget, need: int, ubatch: int, per_layer: float) -> Split | None:
    """With several GPUs, where a load needing `need` bytes of GPU memory (one GPU's reserve
    included, `per_layer` bytes of weights a layer) goes: all of it on the GPU with the most free
    memory when it fits there (no traffic between GPUs), else a range of layers on each when
    together they hold it and each holds its share; None otherwise."""
    gpus = b.machine.gpus
    best = _most_free(gpus)
    if need <= gpus[best].free_bytes:
        g = gpus[best]
        return Split(
            "none",
            (),
            best,
            f"on GPU {best} ({g.name}: {gib(need)} of its {gib(g.free_bytes)} free), the one of {len(gpus)} with "
            "the most free memory (splitMode none)",
        )
    if need <= b.free(ubatch) and _split_fits(b, b.m.layers + 1, ubatch, per_layer):
        return _layer_split(b, ubatch)
    return None


def _with(plan: PlacementPlan, split: Split) -> PlacementPlan:
    return attrs.evolve(plan, split_mode=split.split_mode, tensor_split=split.tensor_split, main_gpu=split.main_gpu)


class Cpu:
    name = "cpu"

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan:
        return _cpu_plan(Budget(model, machine, options), "placement cpu: every tensor in host memory")


class Gpu:
    name = "gpu"

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan:
        b = Budget(model, machine, options)
        if not machine.has_gpu:
            raise ValueError("placement gpu needs a GPU and llama.cpp found none; use placement cpu or auto")
        need = b.gpu_all(PASS_PLAIN[1])
        split = None
        if len(machine.gpus) >= 2:
            split = _spread(b, need, PASS_PLAIN[1], b.per_layer)
            if split is None:
                raise ValueError(
                    f"everything on the GPUs needs {b.describe(need, model.weight_bytes, PASS_PLAIN[1])} but "
                    f"the {len(machine.gpus)} GPUs have {gib(b.free(PASS_PLAIN[1]))} free together after each "
                    "one's pass buffers" + _gpu_alternatives(b)
                )
            where = split.text
        elif need > machine.gpu_free_bytes:
            raise ValueError(
                f"everything on the GPU needs {b.describe(need, model.weight_bytes, PASS_PLAIN[1])} but "
                f"{gib(machine.gpu_free_bytes)} is free" + _gpu_alternatives(b)
            )
        else:
            where = f"on the GPU ({gib(need)} of {gib(machine.gpu_free_bytes)} free)"
        why = f"placement gpu: every layer {where}"
        plan = PlacementPlan(gpu_layers=-1, batch=PASS_PLAIN[0], ubatch=PASS_PLAIN[1], reason=why)
        return _with(plan, split) if split is not None else plan


class ExpertsHost:
    name = "experts-host"

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan:
        b = Budget(model, machine, options)
        if not model.experts or not model.expert_bytes:
            raise ValueError(
                f"placement experts-host needs a mixture-of-experts model; {model.architecture or 'this model'} "
                "has no ffn_*_exps tensors (use placement auto, gpu or cpu)"
            )
        b.check_host(model.expert_bytes, "keeping the experts in host memory")
        if not machine.has_gpu:
            return PlacementPlan(
                gpu_layers=0,
                host_tensors=(EXPERTS,),
                batch=PASS_EXPERTS[0],
                ubatch=PASS_EXPERTS[1],
                reason="placement experts-host: no GPU, so every tensor is in host memory anyway; passes of 4096",
            )
        need = b.gpu_experts_host(PASS_EXPERTS[1])
        split = None
        if len(machine.gpus) >= 2:
            split = _spread(b, need, PASS_EXPERTS[1], b.per_layer_dense)
            if split is None:
                raise ValueError(
                    f"the model without its experts needs "
                    f"{b.describe(need, model.weight_bytes - model.expert_bytes, PASS_EXPERTS[1])} but the "
                    f"{len(machine.gpus)} GPUs have {gib(b.free(PASS_EXPERTS[1]))} free together after each one's "
                    "pass buffers" + _gpu_alternatives(b)
                )
            rest = f"({gib(need)}) {split.text}"
        elif need > machine.gpu_free_bytes:
            raise ValueError(
                f"the model without its experts needs "
                f"{b.describe(need, model.weight_bytes - model.expert_bytes, PASS_EXPERTS[1])} but "
                f"{gib(machine.gpu_free_bytes)} is free" + _gpu_alternatives(b)
            )
        else:
            rest = f"on the GPU ({gib(need)})"
        plan = PlacementPlan(
            gpu_layers=-1,
            host_tensors=(EXPERTS,),
            batch=PASS_EXPERTS[0],
            ubatch=PASS_EXPERTS[1],
            reason=(
                f"placement experts-host: {model.experts} experts x {model.layers} layers "
                f"({gib(model.expert_bytes)}) in host memory, the rest {rest}; "
                "prompt passes of 4096 tokens, each rereading the experts once"
            ),
        )
        return _with(plan, split) if split is not None else plan


class Auto:
    name = "auto"

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan:
        b = Budget(model, machine, options)
        if not machine.has_gpu:
            return _cpu_plan(b, "placement auto: no GPU, every tensor in host memory")
        if len(machine.gpus) >= 2:
            return self._several(b)
        free = machine.gpu_free_bytes
        need = b.gpu_all(PASS_PLAIN[1])
        if need <= free:
            return PlacementPlan(
                gpu_layers=-1,
                batch=PASS_PLAIN[0],
                ubatch=PASS_PLAIN[1],
                reason=f"placement auto: everything fits on the GPU ({gib(need)} of {gib(free)} free)",
            )
        if model.experts and model.expert_bytes and b.gpu_experts_host(PASS_EXPERTS[1]) <= free:
            plan = ExpertsHost().plan(model, machine, options)
            return PlacementPlan(
                gpu_layers=plan.gpu_layers,
                host_tensors=plan.host_tensors,
                batch=plan.batch,
                ubatch=plan.ubatch,
                reason=f"placement auto: the whole model needs {gib(need)} but {gib(free)} is free; " + plan.reason,
            )
        n = b.max_layers(PASS_PLAIN[1])
        if n > 0:
            b.check_host(int(b.per_layer * (model.layers - n)) + model.outside_bytes, "the layers left in host memory")
            return PlacementPlan(
                gpu_layers=n,
                batch=PASS_PLAIN[0],
                ubatch=PASS_PLAIN[1],
                reason=(
                    f"placement auto: the whole model needs {gib(need)} but {gib(free)} is free; "
                    f"{n} of {model.layers} layers on the GPU, the rest in host memory"
                ),
            )
        return _cpu_plan(
            b, f"placement auto: not even one layer fits in {gib(free)} of GPU memory; every tensor in host memory"
        )

    def _several(self, b: Budget) -> PlacementPlan:
        """Several GPUs: the one-GPU order of choices, each over the GPUs as _spread says."""
        m, gpus = b.m, b.machine.gpus
        need = b.gpu_all(PASS_PLAIN[1])
        split = _spread(b, need, PASS_PLAIN[1], b.per_layer)
        if split is not None:
            if split.split_mode == "none":
                why = f"placement auto: everything fits {split.text}"
            else:
                why = (
                    f"placement auto: the whole model needs {gib(need)}, more than any one of the {len(gpus)} GPUs "
                    f"has free; every layer {split.text}"
                )
            return _with(PlacementPlan(gpu_layers=-1, batch=PASS_PLAIN[0], ubatch=PASS_PLAIN[1], reason=why), split)
        if need <= b.free(PASS_PLAIN[1]):
            together = (
                f"the whole model ({gib(need)}) does not split into whole layers that fit each of the {len(gpus)} GPUs"
            )
        else:
            together = f"the whole model needs {gib(need)} but the {len(gpus)} GPUs hold {gib(b.free(PASS_PLAIN[1]))}"
        if m.experts and m.expert_bytes:
            split = _spread(b, b.gpu_experts_host(PASS_EXPERTS[1]), PASS_EXPERTS[1], b.per_layer_dense)
            if split is not None:
                plan = ExpertsHost().plan(m, b.machine, b.o)
                return _with(
                    PlacementPlan(
                        gpu_layers=plan.gpu_layers,
                        host_tensors=plan.host_tensors,
                        batch=plan.batch,
                        ubatch=plan.ubatch,
                        reason=f"placement auto: {together}; " + plan.reason,
                    ),
                    split,
                )
        n = _max_split_layers(b, PASS_PLAIN[1])
        if n > 0:
            b.check_host(int(b.per_layer * (m.layers - n)) + m.outside_bytes, "the layers left in host memory")
            split = _layer_split(b, PASS_PLAIN[1])
            why = f"placement auto: {together}; {n} of {m.layers} layers {split.text}, the rest in host memory"
            return _with(PlacementPlan(gpu_layers=n, batch=PASS_PLAIN[0], ubatch=PASS_PLAIN[1], reason=why), split)
        why = f"placement auto: not even one layer fits in the {len(gpus)} GPUs' free memory"
        return _cpu_plan(b, why + "; every tensor in host memory")


@kinfer_rpc.hookimpl
def register_placements(register: Callable[[Placement], None]) -> None:
    for placement in (Auto(), Gpu(), Cpu(), ExpertsHost()):
        register(placement)
