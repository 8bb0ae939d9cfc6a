"""Security: the server opens no network listener.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import os

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import (
    children_of,
)
from rpcclient import result_of

pytestmark = pytest.mark.model  # every test here loads a real model


def _sockets(pid: int) -> dict[int, tuple[str, list[str]]]:
    """The process's socket inodes -> (the /proc/net table it appears in, its columns there)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    inode_column = {
        "unix": 6,
        "tcp": 9,
        "tcp6": 9,
        "udp": 9,
        "udp6": 9,
        "raw": 9,
        "raw6": 9,
        "udplite": 9,
        "udplite6": 9,
        "packet": -1,
        "netlink": -1,
    }
    found: dict[int, tuple[str, list[str]]] = {}
    for table, col in inode_column.items():
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = [line.split() for line in f.read().splitlines()[1:]]
        except OSError:
            continue
        for cols in rows:
            if len(cols) > abs(col) and cols[col].isdigit() and int(cols[col]) in inodes:
                found[int(cols[col])] = (table, cols)
    for inode in inodes - set(found):
        found[inode] = ("unknown", [])
    return found


def test_no_network_listener_exists(spawn):
    c = spawn()
    c.initialize({"initializationOptions": {"logLevel": "debug"}})
    c.load_model(slots=2)
    rid = c.request_async(
        "inference/generate",
        {"prompt": "Once", "partialResultToken": "n", "options": {"maxTokens": 50, "ignoreEos": True}},
    )
    c.wait_for(lambda m: m.get("method") == "$/progress", timeout=30)
    pids = [c.proc.pid, *children_of(c.proc.pid)]
    assert pids == [c.proc.pid], "the server started processes"
    sockets = _sockets(c.proc.pid)
    print("sockets of the server:", sockets)
    for _inode, (table, cols) in sockets.items():
        # asyncio's self-pipe is a connected, unnamed AF_UNIX socket pair; nothing else is allowed
        assert table == "unix", (table, cols)
        flags, state, path = int(cols[3], 16), cols[5], cols[7:]
        assert flags & 0x10000 == 0, f"a listening unix socket: {cols}"  # __SO_ACCEPTCON
        assert state == "03" and path == [], cols  # connected, unbound
    result_of(c.response(rid, timeout=60))
