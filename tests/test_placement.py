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
from rpcclient import RpcClient, error_of, result_of

from kinfer_rpc.default_plugins import llama_buft as llama_cpp_buft
from kinfer_rpc.default_plugins import placements as P
from kinfer_rpc.host.runtime import model_facts
from kinfer_rpc.host.store import ModelStore
from kinfer_rpc.types import LoadOptions, MachineInfo

GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
