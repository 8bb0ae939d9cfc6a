"""Inputs that used to crash the server or reach the wrong request, through the protocol: each
answered with a documented error while the server keeps serving."""

from __future__ import annotations

import subprocess

import pytest
from rpcclient import KINFER_RPC, RpcClient

GREEDY = {"temperature": 0, "maxTokens": 64, "ignoreEos": True}


def _serving(c: RpcClient) -> None:
    assert "models" in c.call("model/list", {}, timeout=30)


def test_a_content_length_of_5000_digits_is_32700_and_the_server_goes_on():
    with RpcClient.spawn() as c:
        c.initialize()
        c.send_raw(b"Content-Length: " + b"7" * 5000 + b"\r\n\r\n{}")
        _serving(c)
        errors = [m for m in c.messages if m.get("id") is None and "error" in m]
        assert errors and errors[0]["error"]["code"] == -32700
        c.call("shutdown")
        c.notify("exit")
        assert c.wait_exit(10) == 0


@pytest.mark.model
def test_cancel_ids_compare_by_json_type():
    """`true` is not request 1 and 2.0 is not request 2, though Python's == says so."""
    with RpcClient.spawn() as c:
        c.initialize()
        c.call("model/load", {"options": {"contextLength": 256, "slots": 2}}, timeout=120)
        one = c.request_async("inference/generate", {"prompt": "Once upon a time", "options": GREEDY}, id=1)
        two = c.request_async("inference/generate", {"prompt": "Once upon a time", "options": GREEDY}, id=2)
        c.notify("$/cancelRequest", {"id": True})
        c.notify("$/cancelRequest", {"id": 2.0})
        for rid in (one, two):
            response = c.response(rid, timeout=120)
            assert "result" in response, response  # neither was cancelled
            assert response["result"]["usage"]["completionTokens"] == 64


@pytest.mark.model
def test_unloading_the_empty_name_unloads_nothing():
    with RpcClient.spawn() as c:
        c.initialize()
        name = c.call("model/load", {"options": {"contextLength": 256, "slots": 1}}, timeout=120)["model"]
        response = c.request("model/unload", {"model": ""})
        assert response["error"]["code"] == -32602
        assert [m["model"] for m in c.call("model/status", {})["models"]] == [name]


@pytest.mark.parametrize("pid", ["1099511627776", "-1", "0", "x"])
def test_a_client_process_id_no_process_can_have_is_refused_at_start(pid):
    out = subprocess.run([KINFER_RPC, "--clientProcessId", pid], input=b"", capture_output=True, timeout=60)
    assert out.returncode == 2  # argparse's usage error, not a traceback
    assert b"not a process id" in out.stderr and b"Traceback" not in out.stderr
