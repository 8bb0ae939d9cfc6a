"""Whether a load promises the same reply whatever else runs: `reproducible` in model/load's options
and result (spec: Reproducibility). The promise itself is tested in test_invariance.py,
test_engine.py and test_promise.py; these check what a load says about it and what it refuses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kinfer_rpc.client import Client, RpcError
from kinfer_rpc.default_plugins.llama import library
from kinfer_rpc.default_plugins.llama import native as llama_native

SWITCH = llama_native.CUDA_SWITCH


def test_the_cuda_library_is_recognised_by_the_switch_it_names(tmp_path: Path) -> None:
    patched, stock, none = tmp_path / "patched", tmp_path / "stock", tmp_path / "none"
    for d in (patched, stock, none):
        d.mkdir()
    (patched / "libggml-cuda.so.0").write_bytes(
        b"\x7fELF...GGML_CUDA_BATCH_INVARIANT_KV_SPLIT\0GGML_CUDA_BATCH_INVARIANT\0"
    )
    # the longer name alone, or the name inside a message, is not the switch
    (stock / "libggml-cuda.so").write_bytes(
        b"\x7fELF...GGML_CUDA_BATCH_INVARIANT_KV_SPLIT\0(GGML_CUDA_BATCH_INVARIANT=0)"
    )
    assert llama_native.cuda_batch_invariant(patched) is True
    assert llama_native.cuda_batch_invariant(stock) is False
    assert llama_native.cuda_batch_invariant(none) is None


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("1", 1), (" 12x", 12), ("-3", -3), ("abc", 0), ("", 0)])
def test_the_switch_is_read_as_ggml_reads_it(text: str, value: int) -> None:
    assert library.leading_int(text) == value


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As if no GPU load had run in this process, with kinfer's CUDA kernels in the library."""
    saved = os.environ.pop(SWITCH, None)
    monkeypatch.setattr(library, "_cuda_invariant", None)
    monkeypatch.setattr(llama_native, "cuda_batch_invariant", lambda folder=None: True)
    yield
    os.environ.pop(SWITCH, None)
    if saved is not None:
        os.environ[SWITCH] = saved


def test_the_first_gpu_load_sets_the_kernels_for_the_process(fresh_process: None) -> None:
    promised, reason = library.cuda_kernels(None)
    assert promised and "batch-invariant kernels" in reason
    assert SWITCH not in os.environ  # the library's default: on
    assert library.cuda_kernels(False)[0], "a later load cannot switch the kernels off"


def test_a_first_load_asking_for_speed_turns_the_kernels_off(fresh_process: None) -> None:
    promised, reason = library.cuda_kernels(False)
    assert not promised and f"{SWITCH}=0" in reason
    assert os.environ[SWITCH] == "0"
    assert not library.cuda_kernels(True)[0], "the switch is read once per process"


def test_the_environment_wins_over_the_load(fresh_process: None) -> None:
    os.environ[SWITCH] = "0"
    assert not library.cuda_kernels(True)[0]


def test_without_kinfers_kernels_a_gpu_load_promises_nothing(fresh_process: None, monkeypatch) -> None:
    monkeypatch.setattr(llama_native, "cuda_batch_invariant", lambda folder=None: None)
    promised, reason = library.cuda_kernels(True)
    assert not promised and "chosen by the shape of each pass" in reason


@pytest.mark.model
def test_a_load_says_whether_it_keeps_the_promise() -> None:
    with Client() as kinfer:
        default = kinfer.request("model/load", {"options": {"contextLength": 256, "slots": 2}})
        assert default["reproducible"]["promised"] is True
        assert "q8_0" in default["reproducible"]["reason"]
        status = kinfer.request("model/status", {})["models"][0]
        assert status["reproducible"] == default["reproducible"]
        kinfer.unload(default["model"])

        f16 = kinfer.request("model/load", {"options": {"contextLength": 256, "kvType": "f16"}})
        assert f16["reproducible"]["promised"] is False
        assert "f16 KV cells on the CPU" in f16["reproducible"]["reason"]
        kinfer.unload(f16["model"])

        fast = kinfer.request("model/load", {"options": {"contextLength": 256, "reproducible": False}})
        assert fast["reproducible"]["promised"] is False
        assert kinfer.request("model/status", {})["models"][0]["memory"]["kvType"] == "f16"
        kinfer.unload(fast["model"])

        with pytest.raises(RpcError) as refused:
            kinfer.request("model/load", {"options": {"contextLength": 256, "kvType": "f16", "reproducible": True}})
        assert refused.value.code == -32602
        assert "options.reproducible" in str(refused.value) and "f16" in refused.value.data["reason"]
        assert kinfer.request("model/status", {})["models"] == []  # the refused load left nothing behind

        kept = kinfer.request("model/load", {"options": {"contextLength": 256, "reproducible": True}})
        assert kept["reproducible"]["promised"] is True
        assert kinfer.generate("Say hi.", kept["model"], maxTokens=4).usage.completion_tokens > 0
