"""Wrong answers to odd but legal input: option ranges as the spec states them, capped stop
strings, errors that do not repeat a huge input whole, and the embedded default model reachable
whatever a store holds under its name."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from kinfer_rpc import errors
from kinfer_rpc.engine.sampling import SamplingOptions, _penalise
from kinfer_rpc.host.options import MAX_STOP_CHARS, MAX_STOPS
from kinfer_rpc.host.store import DEFAULT_MODEL, ModelStore, embedded_default_path
from kinfer_rpc.protocol.options import request_options

ECHO = 1024  # the most of one string an error repeats (spec: Errors)


def _refused(options: dict) -> errors.KinferError:
    with pytest.raises(errors.KinferError) as info:
        request_options(options).resolve(1)
    assert info.value.code == errors.INVALID_PARAMS
    return info.value


@pytest.mark.parametrize("penalty", [0.001, 1e-9, 5e-324, 1.0, 100.0])
def test_repeat_penalty_takes_the_spec_range(penalty: float) -> None:
    assert request_options({"repeatPenalty": penalty}).resolve(1).sampling.repeat_penalty == penalty
    # even a penalty next to 0 leaves finite logits
    out = _penalise(np.array([30.0, -2.0, 1.0], dtype=np.float32), [0, 1], SamplingOptions(repeat_penalty=penalty))
    assert np.isfinite(out).all()


@pytest.mark.parametrize("penalty", [0, 0.0, -1.0, 100.5])
def test_repeat_penalty_outside_the_range_is_refused(penalty: float) -> None:
    assert "repeatPenalty" in _refused({"repeatPenalty": penalty}).message


def test_stop_strings_are_capped() -> None:
    assert len(request_options({"stop": ["x"] * MAX_STOPS}).resolve(1).stop) == MAX_STOPS
    assert len(request_options({"stop": ["y" * MAX_STOP_CHARS]}).resolve(1).stop[0]) == MAX_STOP_CHARS
    err = _refused({"stop": [str(i) for i in range(60_000)]})
    assert err.data == {"stops": 60_000, "longest": 5} and str(MAX_STOPS) in err.message
    assert "characters" in _refused({"stop": "z" * (MAX_STOP_CHARS + 1)}).message


def test_an_error_repeats_at_most_a_kilobyte_of_its_input(bare) -> None:
    name = "m" * 5_000_000
    t = time.perf_counter()
    response = bare.request("model/load", {"model": name}, timeout=60)
    err = response["error"]
    assert err["code"] == errors.MODEL_NOT_FOUND
    assert len(err["message"]) < 2 * ECHO and "more characters" in err["message"]
    assert err["data"]["model"].startswith("m" * ECHO) and len(err["data"]["model"]) < 1100
    assert time.perf_counter() - t < 30
    unknown = bare.request("x" * 100_000, {})["error"]
    assert unknown["code"] == errors.METHOD_NOT_FOUND
    assert len(unknown["message"]) < 2 * ECHO and len(str(unknown.get("data"))) < 1100
    assert bare.call("model/list") is not None  # still serving


def test_clipping_leaves_a_cancelled_requests_partial_reply_whole() -> None:
    partial = {"code": errors.REQUEST_CANCELLED, "message": "cancelled", "data": {"text": "t" * 5000}}
    assert errors.clip_echoes(partial) == partial
    nested = errors.clip_echoes({"code": -32602, "message": "ok", "data": {"a": ["b" * 5000]}})
    assert len(nested["data"]["a"][0]) < 1100


def test_a_store_model_named_like_the_default_does_not_hide_it(tmp_path, monkeypatch) -> None:
    """No name is the embedded default; the name itself is the user's own model, not an error."""
    kinfer = tmp_path / "kinfer"
    kinfer.mkdir()
    shutil.copy(embedded_default_path(), kinfer / f"{DEFAULT_MODEL}.gguf")
    monkeypatch.setenv("KINFER_MODELS", str(kinfer))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    store = ModelStore()
    assert sorted(r.source for r in store.list() if r.name == DEFAULT_MODEL) == ["embedded", "kinfer"]
    assert store.resolve(None).source == "embedded"
    assert store.resolve(DEFAULT_MODEL).source == "kinfer"
