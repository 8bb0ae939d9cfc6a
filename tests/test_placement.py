"""Placements (issue 8): the built-in plans, the tensor_buft_overrides patch, and loads through the
server on real models: the embedded SmolLM2 (dense) and a Qwen3-MoE-shaped GGUF written by
tests/modelgen/make_moe_model.py (random weights, real llama.cpp).

The plan tests feed the built-in placements the facts read from the real files' headers and the
machines a placement must handle (this machine has no GPU, so a GPU's free memory is stated);
what those plans do on a real GPU is measured by bench/moe_bench.py on the H200.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from paths import ROOT
from rpcclient import RpcClient, error_of, result_of

from kinfer_rpc.default_plugins import placements as P
from kinfer_rpc.default_plugins.llama import buft as llama_cpp_buft
from kinfer_rpc.host.runtime import model_facts
from kinfer_rpc.host.store import ModelStore
from kinfer_rpc.types import GpuInfo, LoadOptions, MachineInfo, ModelFacts, PlacementPlan

GiB = 1 << 30


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "modelgen", "make_moe_model.py"), str(path), "--shape", "tiny"],
        check=True,
    )
    return str(path)


@pytest.fixture(scope="module")
def smol_path():
    return ModelStore().resolve(None).path


def scaled(facts, factor):
    """The same model's facts with every byte count scaled (a 30B model from a tiny one's shape)."""
    import attrs

    return attrs.evolve(
        facts,
        weight_bytes=facts.weight_bytes * factor,
        expert_bytes=facts.expert_bytes * factor,
        outside_bytes=facts.outside_bytes * factor,
        size_bytes=facts.size_bytes * factor,
    )


# -- facts from the header ---------------------------------------------------------------------
def test_facts_of_a_moe_model(moe_path):
    f = model_facts(moe_path)
    assert (f.architecture, f.layers, f.experts, f.experts_used, f.n_embd, f.n_ff) == ("qwen3moe", 2, 8, 2, 64, 32)
    # 3 expert tensors a layer, 8 x 32 x 64 F32 each
    assert f.expert_bytes == 2 * 3 * 8 * 32 * 64 * 4
    assert 0 < f.outside_bytes < f.weight_bytes - f.expert_bytes
    assert f.kv_bytes_per_cell == 2 * 2 * (32 + 32) * 2  # layers x kv heads x (k + v) x f16


def test_facts_of_a_dense_model(smol_path):
    f = model_facts(smol_path)
    assert f.architecture == "llama" and f.layers == 30 and f.experts == 0 and f.expert_bytes == 0
    assert f.kv_bytes_per_cell == 30 * 3 * (64 + 64) * 2


# -- the plans ---------------------------------------------------------------------------------
def test_auto_without_gpu_is_cpu(moe_path):
    plan = P.Auto().plan(model_facts(moe_path), MachineInfo(host_free_bytes=8 * GiB), LoadOptions())
    assert plan.gpu_layers == 0 and plan.host_tensors == () and (plan.batch, plan.ubatch) == (2048, 512)
    assert "no GPU" in plan.reason


def test_auto_prefers_everything_on_the_gpu(moe_path):
    facts = scaled(model_facts(moe_path), 20000)  # ~16 GiB of weights
    plan = P.Auto().plan(
        facts, MachineInfo(gpu_free_bytes=80 * GiB, has_gpu=True, host_free_bytes=100 * GiB), LoadOptions()
    )
    assert plan.gpu_layers == -1 and plan.host_tensors == () and plan.batch == 2048


def test_auto_keeps_experts_in_host_memory_when_the_model_does_not_fit(moe_path):
    facts = scaled(model_facts(moe_path), 20000)
    machine = MachineInfo(gpu_free_bytes=12 * GiB, has_gpu=True, host_free_bytes=100 * GiB)
    plan = P.Auto().plan(facts, machine, LoadOptions())
    assert plan.gpu_layers == -1 and plan.host_tensors == (P.EXPERTS,)
    assert (plan.batch, plan.ubatch) == (4096, 4096)
    assert "experts-host" in plan.reason and "4096" in plan.reason


def test_auto_falls_back_to_layers_for_a_dense_model(smol_path):
    facts = scaled(model_facts(smol_path), 200)  # ~18 GiB, no experts
    machine = MachineInfo(gpu_free_bytes=8 * GiB, has_gpu=True, host_free_bytes=100 * GiB)
    plan = P.Auto().plan(facts, machine, LoadOptions())
    assert 0 < plan.gpu_layers < facts.layers and plan.host_tensors == ()
    b = P.Budget(facts, machine, LoadOptions())
    assert b.gpu_layers(plan.gpu_layers, 512) <= machine.gpu_free_bytes < b.gpu_layers(plan.gpu_layers + 1, 512)


def test_gpu_placement_says_what_would_fit(moe_path):
    facts = scaled(model_facts(moe_path), 20000)
    machine = MachineInfo(gpu_free_bytes=12 * GiB, has_gpu=True, host_free_bytes=100 * GiB)
    with pytest.raises(ValueError) as err:
        P.Gpu().plan(facts, machine, LoadOptions())
    msg = str(err.value)
    assert "12.0 GiB is free" in msg and "would fit: placement experts-host" in msg and "placement cpu" in msg


def test_the_compute_buffer_of_the_larger_pass_is_in_the_budget(moe_path):
    # Qwen3-30B-A3B's numbers: a 4096-row pass needs 2-3 GiB of buffers.
    import attrs

    facts = attrs.evolve(model_facts(moe_path), n_vocab=151936, n_embd=2048, n_ff=768, experts_used=8)
    b = P.Budget(facts, MachineInfo(), LoadOptions())
    assert 2 * GiB <= b.compute(4096) <= 3 * GiB
    assert b.compute(512) < b.compute(4096) / 7


def test_a_long_context_that_does_not_fit_names_one_that_does(smol_path):
    facts = model_facts(smol_path)
    machine = MachineInfo(gpu_free_bytes=2 * GiB, has_gpu=True, host_free_bytes=100 * GiB)
    opts = LoadOptions(context_length=1 << 20, slots=4)
    with pytest.raises(ValueError) as err:
        P.Gpu().plan(facts, machine, opts)
    msg = str(err.value)
    assert "contextLength" in msg
    ctx = int(msg.split("contextLength ")[1].split()[0])
    assert P.Gpu().plan(facts, machine, LoadOptions(context_length=ctx, slots=4)).gpu_layers == -1


def test_experts_host_refuses_a_dense_model(smol_path):
    with pytest.raises(ValueError, match="has no ffn_\\*_exps tensors"):
        P.ExpertsHost().plan(model_facts(smol_path), MachineInfo(has_gpu=True, gpu_free_bytes=80 * GiB), LoadOptions())


def test_host_memory_is_checked(moe_path):
    with pytest.raises(ValueError, match="host memory"):
        P.Cpu().plan(scaled(model_facts(moe_path), 20000), MachineInfo(host_free_bytes=1 * GiB), LoadOptions())


# -- the patch -----------------------------------------------------------------------------------
def test_patch_types_the_overrides_field():
    import llama_cpp

    cls = llama_cpp_buft.apply(llama_cpp)
    assert cls is llama_cpp.llama_model_params
    field = dict(cls._fields_)["tensor_buft_overrides"]
    assert field is not ctypes.c_void_p and field._type_.__name__ == "llama_model_tensor_buft_override"
    assert llama_cpp.llama_model_default_params.restype is cls
    assert cls in llama_cpp.llama_model_load_from_file.argtypes
    assert llama_cpp_buft.apply(llama_cpp) is cls  # idempotent
    params = llama_cpp.llama_model_default_params()  # a real call through the re-declared function
    assert not params.tensor_buft_overrides and params.n_gpu_layers != 12345


def test_patch_leaves_an_upstream_binding_alone():
    class Bound(ctypes.Structure):
        _fields_ = [
            ("devices", ctypes.c_void_p),
            ("tensor_buft_overrides", ctypes.POINTER(llama_cpp_buft.llama_model_tensor_buft_override)),
            ("n_gpu_layers", ctypes.c_int32),
        ]

    class Upstream:  # a llama_cpp module whose struct already binds the field
        llama_model_params = Bound

    assert llama_cpp_buft.apply(Upstream) is Bound and Upstream.llama_model_params is Bound


def test_overrides_array_is_null_terminated():
    import llama_cpp

    llama_cpp_buft.apply(llama_cpp)
    buft = llama_cpp_buft.Ggml().cpu_buft()
    o = llama_cpp_buft.Overrides(llama_cpp, ["a", "b\\.c"], buft)
    p = o.pointer
    assert [p[0].pattern, p[1].pattern, p[2].pattern] == [b"a", b"b\\.c", None]
    assert p[0].buft == buft and not p[2].buft
    assert llama_cpp_buft.Ggml().buft_name(buft) == b"CPU"


@pytest.mark.model
def test_experts_really_stay_in_host_buffers(moe_path, caplog):
    """llama.cpp logs every tensor an override moved; only the expert tensors move, and the
    model computes the same logits either way on the CPU."""
    from kinfer_rpc.default_plugins import llama as kinfer_llama
    from kinfer_rpc.types import SeqChunk

    logits = []
    for host in ((), (P.EXPERTS,)):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="kinfer_rpc.llama"):
            m = kinfer_llama.LlamaBackend().load(
                moe_path, LoadOptions(context_length=256, slots=1, gpu_layers=0, host_tensors=host), lambda f: None
            )
        try:
            toks = m.tokenize("The experts stay in host memory.", True, True)
            logits.append(np.array(m.decode([SeqChunk(0, 0, toks, 1)])()))
        finally:
            m.close()
        moved = sorted(r.getMessage().split()[1] for r in caplog.records if "overridden to CPU" in r.getMessage())
        if host:
            assert moved == sorted(f"blk.{i}.ffn_{w}_exps.weight" for i in range(2) for w in ("gate", "up", "down"))
        else:
            assert moved == []
    assert np.array_equal(logits[0], logits[1])


@pytest.mark.model
def test_default_threads_follow_where_the_layers_are(smol_path):
    """A load naming no thread count gets the CPU count, except with every layer and the output
    on a GPU and nothing in host memory: then llama.cpp's threads only look up embeddings, and 2
    leave the cores to the engine's host work (measured on the H200, docs/performance.md). This
    machine has no GPU: the model loads on the CPU, and the rule is asked as if it had one."""
    from kinfer_rpc.default_plugins import llama as kinfer_llama

    m = kinfer_llama.LlamaBackend().load(smol_path, LoadOptions(context_length=64, slots=1), lambda f: None)
    try:
        cpus = max(1, os.cpu_count() or 1)
        layers = m.L.llama_model_n_layer(m.model)
        assert m.on_cpu and m.default_threads(LoadOptions()) == cpus
        m.on_cpu = False  # the same model, as a GPU load would see it
        assert m.default_threads(LoadOptions()) == min(cpus, 2)
        assert m.default_threads(LoadOptions(gpu_layers=layers + 1)) == min(cpus, 2)
        assert m.default_threads(LoadOptions(gpu_layers=layers)) == cpus  # the output layer on the CPU
        assert m.default_threads(LoadOptions(host_tensors=(P.EXPERTS,))) == cpus
    finally:
        m.on_cpu = True
        m.close()


# -- through the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with RpcClient.spawn() as c:
        c.initialize()
        yield c


def test_initialize_lists_the_builtin_placements():
    with RpcClient.spawn() as c:
        result = c.initialize()
    assert {"auto", "gpu", "cpu", "experts-host"} <= set(result["capabilities"]["placements"])


@pytest.mark.model
def test_default_load_reports_its_placement(server):
    r = server.load_model()
    assert r["placement"] == "auto" and "no GPU" in r["placementReason"]
    assert (r["batch"], r["ubatch"], r["gpuLayers"], r["hostTensors"]) == (2048, 512, 0, [])
    st = server.call("model/status", {"model": r["model"]})["models"][0]
    assert (st["placement"], st["placementReason"], st["batch"], st["ubatch"]) == (
        "auto",
        r["placementReason"],
        2048,
        512,
    )
    server.call("model/unload", {"model": r["model"]})


@pytest.mark.model
def test_experts_host_load_generates_and_reports(server, moe_path):
    r = server.load_model(moe_path, placement="experts-host")
    assert r["placement"] == "experts-host" and r["hostTensors"] == [P.EXPERTS]
    assert (r["batch"], r["ubatch"]) == (4096, 4096) and "4096" in r["placementReason"]
    st = server.call("model/status", {"model": r["model"]})["models"][0]
    assert st["hostTensors"] == [P.EXPERTS] and st["batch"] == 4096
    params = {"model": r["model"], "prompt": "hello experts", "options": {"maxTokens": 6, "temperature": 0}}
    a = server.call("inference/generate", params)
    server.call("model/unload", {"model": r["model"]})
    r2 = server.load_model(moe_path, placement="cpu")
    assert r2["placement"] == "cpu" and r2["hostTensors"] == [] and r2["batch"] == 2048
    b = server.call("inference/generate", params)
    server.call("model/unload", {"model": r2["model"]})
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 6


@pytest.mark.model
def test_user_options_win_over_the_plan(server, moe_path):
    r = server.load_model(moe_path, placement="experts-host", batch=1024, slots=2)
    assert (r["batch"], r["ubatch"]) == (1024, 1024) and "batch 1024 set by the load options" in r["placementReason"]
    server.call("model/unload", {"model": r["model"]})
    r = server.load_model(moe_path, gpuLayers=0)
    assert r["placement"] is None and "gpuLayers 0 set by the load options" in r["placementReason"]
    server.call("model/unload", {"model": r["model"]})


@pytest.mark.model
def test_mistakes_are_clear_errors_and_the_server_goes_on(server, moe_path):
    e = error_of(server.request("model/load", {"model": None, "options": {"placement": "experts-host"}}))
    assert e["code"] == -31003 and "no ffn_*_exps tensors" in e["message"]
    e = error_of(server.request("model/load", {"model": None, "options": {"placement": "gpu"}}))
    assert e["code"] == -31003 and "needs a GPU" in e["message"]
    e = error_of(server.request("model/load", {"model": None, "options": {"placement": "nowhere"}}))
    assert e["code"] == -32602 and "experts-host" in e["message"]
    e = error_of(server.request("model/load", {"model": None, "options": {"placement": 3}}))
    assert e["code"] == -32602
    assert server.call("model/status")["models"] == []
    r = result_of(server.request("model/load", {"model": None, "options": {"contextLength": 256, "slots": 1}}))
    assert r["placement"] == "auto"
    server.call("model/unload", {"model": r["model"]})
    server.assert_clean()


# -- several GPUs ------------------------------------------------------------------------------
# Machines of 2, 4 and 8 GPUs of stated sizes (this machine has none); the split each plan asks
# for reaches llama.cpp's params (test_split_params_reach_the_model_params) and what it does on
# two real GPUs is measured by bench/gpu_multi.sh.

# Qwen3-30B-A3B at Q4_K_M, by its header's numbers: 48 layers, 128 experts (8 used), 17.3 GiB
QWEN3_30B = ModelFacts(
    path="qwen3-30b-a3b.gguf",
    size_bytes=int(17.3 * GiB),
    layers=48,
    experts=128,
    architecture="qwen3moe",
    experts_used=8,
    weight_bytes=int(17.3 * GiB),
    expert_bytes=int(15.9 * GiB),
    outside_bytes=int(0.6 * GiB),
    n_embd=2048,
    n_vocab=151936,
    n_ff=768,
    kv_bytes_per_cell=48 * 4 * (128 + 128) * 2,
)


def gpus(*free_gib, total_gib=80):
    """A machine of GPUs with this much free memory each, in llama.cpp's device order."""
    return MachineInfo.of_gpus(
        [GpuInfo(f"CUDA{i}", int(f * GiB), total_gib * GiB) for i, f in enumerate(free_gib)],
        host_free_bytes=200 * GiB,
    )


@pytest.fixture(scope="module")
def dense18(smol_path):
    return scaled(model_facts(smol_path), 200)  # ~18 GiB of weights, 30 layers, no experts


def test_machine_of_gpus_keeps_the_sums():
    m = gpus(10, 30.5, total_gib=40)
    assert (m.gpu_free_bytes, m.gpu_total_bytes, m.has_gpu) == (int(40.5 * GiB), 80 * GiB, True)
    assert [g.name for g in m.gpus] == ["CUDA0", "CUDA1"]
    assert MachineInfo.of_gpus([]) == MachineInfo()


def test_one_gpu_plans_set_no_split(dense18):
    for machine in (MachineInfo(gpu_free_bytes=80 * GiB, has_gpu=True), gpus(80), gpus(8)):
        plan = P.Auto().plan(dense18, machine, LoadOptions())
        assert (plan.split_mode, plan.tensor_split, plan.main_gpu) == (None, (), None)
        assert "GPUs" not in plan.reason
    assert P.Auto().plan(dense18, gpus(8), LoadOptions()) == P.Auto().plan(
        dense18, MachineInfo(gpu_free_bytes=8 * GiB, has_gpu=True, host_free_bytes=200 * GiB), LoadOptions()
    )


@pytest.mark.parametrize("free", [(10, 30), (30, 10, 30, 5), (1, 2, 3, 4, 5, 6, 40, 7)])
def test_a_model_that_fits_one_gpu_goes_on_the_one_with_the_most_free_memory(dense18, free):
    plan = P.Auto().plan(dense18, gpus(*free), LoadOptions())
    best = free.index(max(free))
    assert (plan.gpu_layers, plan.split_mode, plan.main_gpu, plan.tensor_split) == (-1, "none", best, ())
    assert f"on GPU {best} (CUDA{best}" in plan.reason and "splitMode none" in plan.reason


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_model_larger_than_one_gpu_is_split_by_layer_over_equal_gpus(dense18, n):
    b = P.Budget(dense18, MachineInfo(), LoadOptions())
    need = b.gpu_all(512)
    each = (need / n + b.reserve(512)) / GiB * 1.15  # a share each, with its own pass buffers
    plan = P.Auto().plan(dense18, gpus(*[each] * n), LoadOptions())
    assert (plan.gpu_layers, plan.split_mode, plan.main_gpu, plan.host_tensors) == (-1, "layer", None, ())
    assert plan.tensor_split == (round(1 / n, 4),) * n
    assert f"split by layer over {n} GPUs" in plan.reason and "more than any one" in plan.reason


def test_uneven_gpus_take_shares_in_proportion_to_what_they_have_left(dense18):
    machine = gpus(16, 8)
    plan = P.Auto().plan(dense18, machine, LoadOptions())
    assert plan.gpu_layers == -1 and plan.split_mode == "layer"
    b = P.Budget(dense18, machine, LoadOptions())
    left = [16 * GiB - b.reserve(512), 8 * GiB - b.reserve(512)]  # after each GPU's pass buffers
    assert plan.tensor_split == pytest.approx([left[0] / sum(left), left[1] / sum(left)], abs=1e-4)
    assert plan.tensor_split[0] > 2 / 3  # the reserve weighs more on the smaller GPU
    # and the layers llama.cpp gives each for those shares fit each
    cost = b.per_layer + b.kv / dense18.layers
    counts = P.layer_counts(plan.tensor_split, dense18.layers + 1)
    assert sum(counts) == dense18.layers + 1 and all(c * cost <= u for c, u in zip(counts, left))
    assert f"tensorSplit {plan.tensor_split[0]:g}, {plan.tensor_split[1]:g})" in plan.reason


def test_layer_counts_follow_llama_cpp():
    assert P.layer_counts([0.5, 0.5], 31) == [16, 15]
    assert P.layer_counts([1, 3], 8) == [2, 6]
    assert P.layer_counts([0, 1], 5) == [0, 5]
    assert P.layer_counts([0.25] * 4, 3) == [1, 1, 1, 0]


def test_a_split_that_fits_in_sum_but_not_layer_by_layer_is_not_planned(dense18):
    # Two GPUs whose free memory together holds the model, one of them with room for less than a
    # layer: llama.cpp would give the other every layer, more than it holds. The placement does not
    # rely on the sum: it offloads the layers that fit.
    import attrs

    facts = attrs.evolve(dense18, outside_bytes=int(0.2 * GiB))
    b = P.Budget(facts, MachineInfo(), LoadOptions())
    cost = b.per_layer + b.kv / facts.layers
    machine = gpus((b.reserve(512) + 30 * cost) / GiB, (b.reserve(512) + 0.9 * cost) / GiB)
    b = P.Budget(facts, machine, LoadOptions())
    assert b.gpu_all(512) <= b.free(512)  # the sum holds it
    plan = P.Auto().plan(facts, machine, LoadOptions())
    assert plan.split_mode == "layer" and 0 < plan.gpu_layers <= facts.layers  # not -1: not every layer
    assert "does not split into whole layers that fit each of the 2 GPUs" in plan.reason


def test_moe_experts_stay_in_host_memory_when_the_gpus_together_are_too_small():
    need_all = P.Budget(QWEN3_30B, MachineInfo(), LoadOptions()).gpu_all(512)
    # two 8 GiB GPUs: 17+ GiB of weights do not fit, the model without its experts does on one
    plan = P.Auto().plan(QWEN3_30B, gpus(8, 8), LoadOptions())
    assert plan.host_tensors == (P.EXPERTS,) and (plan.batch, plan.ubatch) == (4096, 4096)
    assert (plan.split_mode, plan.main_gpu) == ("none", 0) and plan.gpu_layers == -1
    assert "experts-host" in plan.reason and "2 GPUs" in plan.reason
    # four 5 GiB GPUs: without the experts it fits only split over them (each keeps 3.4 GiB of pass buffers)
    plan = P.Auto().plan(QWEN3_30B, gpus(5, 5, 5, 5), LoadOptions())
    assert plan.host_tensors == (P.EXPERTS,) and plan.split_mode == "layer" and plan.tensor_split == (0.25,) * 4
    # eight 12 GiB GPUs hold the whole model: no experts in host memory
    plan = P.Auto().plan(QWEN3_30B, gpus(*[12] * 8), LoadOptions())
    assert plan.host_tensors == () and plan.split_mode == "layer" and need_all > 12 * GiB


@pytest.mark.parametrize("n", [2, 4, 8])
def test_too_big_for_every_gpu_together_offloads_what_fits(dense18, n):
    machine = gpus(*[12 / n] * n)
    plan = P.Auto().plan(dense18, machine, LoadOptions())
    assert 0 < plan.gpu_layers < dense18.layers and plan.host_tensors == ()
    assert plan.split_mode == "layer" and plan.tensor_split == (round(1 / n, 4),) * n
    assert f"{plan.gpu_layers} of 30 layers split by layer over {n} GPUs" in plan.reason
    b = P.Budget(dense18, machine, LoadOptions())
    cost = b.per_layer + b.kv / dense18.layers
    left = b.usable(512)
    counts = P.layer_counts(plan.tensor_split, plan.gpu_layers)
    assert all(c * cost <= u for c, u in zip(counts, left))  # this many fit each GPU
    counts = P.layer_counts(plan.tensor_split, plan.gpu_layers + 1)
    assert not all(c * cost <= u for c, u in zip(counts, left))  # one more does not


def test_nothing_fits_any_gpu_is_the_cpu(dense18):
    plan = P.Auto().plan(dense18, gpus(0.5, 0.5), LoadOptions())
    assert plan.gpu_layers == 0 and plan.split_mode is None and "2 GPUs" in plan.reason


def test_gpu_and_experts_host_placements_split_too(dense18):
    plan = P.Gpu().plan(dense18, gpus(12, 12), LoadOptions())
    assert (plan.gpu_layers, plan.split_mode, plan.tensor_split) == (-1, "layer", (0.5, 0.5))
    assert plan.reason.startswith("placement gpu: every layer split by layer over 2 GPUs")
    plan = P.Gpu().plan(dense18, gpus(5, 30), LoadOptions())
    assert (plan.split_mode, plan.main_gpu) == ("none", 1)
    with pytest.raises(ValueError, match="the 2 GPUs have .* free together.*would fit: gpuLayers"):
        P.Gpu().plan(dense18, gpus(6, 6), LoadOptions())
    plan = P.ExpertsHost().plan(QWEN3_30B, gpus(5, 5, 5, 5), LoadOptions())
    assert plan.host_tensors == (P.EXPERTS,) and plan.split_mode == "layer" and len(plan.tensor_split) == 4


# -- the split through the runtime: the user's options win -----------------------------------------
def _split(plan, **options):
    from kinfer_rpc.host.runtime import split_of
    from kinfer_rpc.protocol.options import load_request

    opts, extra = load_request(options).resolve()
    return split_of(plan, opts, extra.given)


def test_the_plans_split_applies_unless_the_options_set_one():
    layer = PlacementPlan(gpu_layers=-1, split_mode="layer", tensor_split=(0.6, 0.4))
    none = PlacementPlan(gpu_layers=-1, split_mode="none", main_gpu=1)
    assert _split(layer) == ({"split_mode": "layer", "tensor_split": (0.6, 0.4), "main_gpu": None}, [])
    assert _split(none) == ({"split_mode": "none", "tensor_split": (), "main_gpu": 1}, [])
    assert _split(PlacementPlan(gpu_layers=-1)) == ({"split_mode": None, "tensor_split": (), "main_gpu": None}, [])
    placed, notes = _split(layer, splitMode="row", mainGpu=1)
    assert placed == {"split_mode": "row", "tensor_split": (0.6, 0.4), "main_gpu": 1}
    assert notes == ["splitMode row set by the load options", "mainGpu 1 set by the load options"]
    placed, notes = _split(none, tensorSplit=[1, 3])  # shares: a split by layer
    assert placed == {"split_mode": "layer", "tensor_split": (1.0, 3.0), "main_gpu": None}
    assert notes == ["tensorSplit [1, 3] set by the load options, so split by layer"]
    placed, notes = _split(layer, mainGpu=0)  # one GPU named: the whole model there
    assert placed == {"split_mode": "none", "tensor_split": (), "main_gpu": 0}
    assert notes == ["mainGpu 0 set by the load options, so every layer on GPU 0 (splitMode none)"]
    placed, _ = _split(none, splitMode="layer")
    assert placed == {"split_mode": "layer", "tensor_split": (), "main_gpu": None}


def test_split_options_are_checked_against_the_machine():
    from kinfer_rpc import errors
    from kinfer_rpc.host.runtime import check_split
    from kinfer_rpc.protocol.options import load_request

    def check(machine, **options):
        opts, extra = load_request(options).resolve()
        check_split(opts, extra.given, machine)

    check(gpus(8, 8), mainGpu=1, tensorSplit=[1, 1])
    check(MachineInfo(gpu_free_bytes=8 * GiB, has_gpu=True), mainGpu=5)  # GPUs not listed: not checked
    with pytest.raises(errors.KinferError, match=r"options.mainGpu 2: the backend sees 2 GPUs \(0 to 1\)") as e:
        check(gpus(8, 8), mainGpu=2)
    assert e.value.code == errors.INVALID_PARAMS
    with pytest.raises(errors.KinferError, match="options.tensorSplit gives 3 shares but the backend sees 2 GPUs"):
        check(gpus(8, 8), tensorSplit=[1, 1, 1])
    with pytest.raises(errors.KinferError, match="options.mainGpu 0: the backend sees no GPU"):
        check(MachineInfo(), mainGpu=0)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"splitMode": "rows"}, "options.splitMode must be one of layer, none, row, tensor"),
        ({"splitMode": 2}, "options.splitMode must be a string"),
        ({"mainGpu": -1}, "options.mainGpu must be between 0 and 15"),
        ({"mainGpu": 16}, "options.mainGpu must be between 0 and 15"),
        ({"mainGpu": 1.5}, "options.mainGpu must be an integer"),
        ({"splitMode": "tensor", "flashAttention": False}, "options.splitMode tensor needs flash attention"),
    ],
)
def test_bad_split_options_are_32602(options, words):
    from kinfer_rpc import errors
    from kinfer_rpc.protocol.options import load_request

    with pytest.raises(errors.KinferError) as e:
        load_request(options)
    assert e.value.code == errors.INVALID_PARAMS and words in e.value.message


def test_split_options_parse():
    from kinfer_rpc.protocol.options import load_request

    opts, extra = load_request({"splitMode": "row", "mainGpu": 3, "tensorSplit": [2, 1]}).resolve()
    assert (opts.split_mode, opts.main_gpu, opts.tensor_split) == ("row", 3, (2.0, 1.0))
    assert {"splitMode", "mainGpu", "tensorSplit"} <= extra.given
    opts, _ = load_request({}).resolve()
    assert (opts.split_mode, opts.main_gpu, opts.tensor_split) == (None, None, ())


# -- the split reaching llama.cpp ----------------------------------------------------------------
def test_split_params_reach_the_model_params():
    from kinfer_rpc.default_plugins.llama import library, model

    L = library.load()
    for mode, value in (("none", 0), ("layer", 1), ("row", 2), ("tensor", 3)):
        assert getattr(L, f"LLAMA_SPLIT_MODE_{mode.upper()}") == value
        p = L.llama_model_default_params()
        keep = model.split_params(L, p, LoadOptions(split_mode=mode, main_gpu=1), local_gpu=True)
        assert (p.split_mode, p.main_gpu) == (value, 1) and keep is None
    p = L.llama_model_default_params()
    keep = model.split_params(L, p, LoadOptions(tensor_split=(0.25, 0.75)), local_gpu=True)
    assert [p.tensor_split[i] for i in range(3)] == [0.25, 0.75, 0.0] and len(keep) == 16
    assert (p.split_mode, p.main_gpu) == (L.LLAMA_SPLIT_MODE_LAYER, 0)  # llama.cpp's defaults kept
    # without a GPU (or RPC server) the mode and main GPU stay llama.cpp's: no main GPU to find
    p = L.llama_model_default_params()
    model.split_params(L, p, LoadOptions(split_mode="none", main_gpu=1), local_gpu=False)
    assert (p.split_mode, p.main_gpu) == (L.LLAMA_SPLIT_MODE_LAYER, 0)


def test_row_split_needs_split_buffers():
    """The CPU backend has no split buffers; check_row_split refuses a GPU that lacks them, which
    this machine can only show by calling the CPU device one."""
    from kinfer_rpc.default_plugins.llama import library, model

    library.load()
    g = llama_cpp_buft.Ggml()
    cpu = next(i for i in range(g.dev_count()) if g.dev_type(g.dev_get(i)) == llama_cpp_buft.DEVICE_CPU)
    assert g.row_split(cpu) is False
    model.check_row_split(g)  # no GPU here: nothing to refuse

    g.dev_type = lambda dev: llama_cpp_buft.DEVICE_GPU  # every device (the CPU's) taken for a GPU
    with pytest.raises(RuntimeError, match="splitMode row needs split buffers, which .* of CPU does not have"):
        model.check_row_split(g)


@pytest.mark.model
def test_split_options_through_the_server(server):
    """On this machine (no GPU) a split mode changes nothing but is reported with its note; a GPU
    named that the backend does not see is -32602."""
    r = server.load_model(splitMode="layer", contextLength=256, slots=1)
    assert r["splitMode"] == "layer" and "tensorSplit" not in r and "mainGpu" not in r
    assert r["placementReason"].endswith("; splitMode layer set by the load options") and r["gpuLayers"] == 0
    server.call("model/unload", {"model": r["model"]})
    r = server.load_model(contextLength=256, slots=1)
    assert not {"splitMode", "tensorSplit", "mainGpu", "devices"} & set(r)  # one machine, no split
    server.call("model/unload", {"model": r["model"]})
    for options, words in (
        ({"mainGpu": 0}, "options.mainGpu 0: the backend sees no GPU"),
        ({"tensorSplit": [1, 1]}, "options.tensorSplit gives 2 shares but the backend sees no GPU"),
        ({"mainGpu": 0, "gpuLayers": 0}, "options.mainGpu 0: the backend sees no GPU"),
    ):
        e = error_of(server.request("model/load", {"model": None, "options": options}))
        assert e["code"] == -32602 and words in e["message"], e
    assert server.call("model/status")["models"] == []
