"""llama.cpp's RPC backend: the devices of `ggml-rpc-server` processes, on this host or others,
as devices of a model load (load option `rpcServers`), so that a model larger than one machine is
spread over several.

ggml's RPC client aborts the process when a server cannot be reached or dies; kinfer's build of
llama.cpp (`patches/llama-rpc-no-abort.patch`) fails the connection instead and lists the server
as failed, which `Servers.check` turns into an error after each pass, and the model fails as a
model whose decode failed does. A load is refused on a llama.cpp without RPC or without the
patch. Before ggml connects, each server is asked for its protocol version here, with a time
limit: one that does not answer is an error naming it, never a hang. Once connected, a server that
stops answering without closing the connection (a stopped process, a hung host, a network that
drops packets) fails the same way after GGML_RPC_TIMEOUT seconds without an answer to one of
ggml's sends or receives (the patch reads it when it connects; kinfer sets 120 unless the
environment says otherwise, 0 waits forever). A pass on a slow server must finish within it.

The protocol has no authentication: run servers on 127.0.0.1 (their default), in a private
network or through an SSH tunnel (docs/rpc.md).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from kinfer_rpc.default_plugins.llama import buft

HELLO = 14  # RPC_CMD_HELLO
PROTOCOL_MAJOR = 7  # RPC_PROTO_MAJOR_VERSION of the vendored ggml
CAPS = 24  # RPC_CONN_CAPS_SIZE
PROBE_SECONDS = float(os.environ.get("KINFER_RPC_CONNECT_SECONDS", "10"))
TIMEOUT_SECONDS = "120"  # GGML_RPC_TIMEOUT's default here: a connected server's longest silence

_lock = threading.Lock()
_in_use: dict[str, int] = {}  # endpoint -> loads using it (ggml keeps one connection an endpoint)


def probe(endpoint: str, timeout: float = PROBE_SECONDS) -> None:
    """Ask a server for its protocol version; ConnectionError naming it if it does not answer as
    ggml's RPC server of this version does. (A server serves one client at a time: this is a
    client for a moment.)"""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(bytes([HELLO]) + struct.pack("<Q", CAPS) + bytes(CAPS))
            data = b""
            while len(data) < 8 + 4 + CAPS:
                chunk = s.recv(8 + 4 + CAPS - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise ConnectionError(f"the RPC server {endpoint} cannot be reached: {exc}") from None
    if len(data) < 12 or struct.unpack("<Q", data[:8])[0] != 4 + CAPS:
        raise ConnectionError(f"{endpoint} does not answer as ggml's RPC server does")
    major, minor, patch = data[8], data[9], data[10]
    if major != PROTOCOL_MAJOR:
        raise ConnectionError(
            f"the RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; this llama.cpp speaks "
            f"{PROTOCOL_MAJOR}.x (run the ggml-rpc-server built with it)"
        )


class _Ggml(buft.Ggml):
    """The ggml registry functions the RPC backend is reached through."""

    def __init__(self) -> None:
        super().__init__()
        self.reg_by_name = self._fn("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p)
        self.proc_address = self._fn(
            "ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
        )
        self.reg_dev_count = self._fn("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t)
        self.reg_dev_get = self._fn("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p)


def build_support() -> tuple[bool, str]:
    """available()'s answer from the library files alone (nothing loaded): libggml-rpc.so beside
    libllama, with kinfer's patch in it."""
    from kinfer_rpc.default_plugins.llama import native

    folder = native.lib_dir()
    lib = folder / "libggml-rpc.so" if folder is not None else None
    if lib is None or not lib.exists():
        return False, "this llama.cpp was built without its RPC backend (GGML_RPC=ON: patches/build_llama.sh)"
    try:
        patched = b"ggml_backend_rpc_endpoint_failed" in lib.read_bytes()
    except OSError as exc:
        return False, f"{lib} cannot be read: {exc}"
    if not patched:
        return False, (
            "this llama.cpp's RPC backend aborts the process when a server dies "
            "(kinfer's build has patches/llama-rpc-no-abort.patch: patches/build_llama.sh)"
        )
    return True, ""


def available() -> tuple[bool, str]:
    """Whether the loaded llama.cpp can spread a model over RPC servers, and why not."""
    g = _Ggml()
    if g.reg_by_name is None or g.proc_address is None:
        return False, "the loaded ggml has no backend registry functions"
    reg = g.reg_by_name(b"RPC")
    if not reg:
        return False, "the loaded llama.cpp was built without its RPC backend (GGML_RPC=ON: patches/build_llama.sh)"
    if not g.proc_address(reg, b"ggml_backend_rpc_endpoint_failed"):
        return False, (
            "the loaded llama.cpp's RPC backend aborts the process when a server dies "
            "(kinfer's build has patches/llama-rpc-no-abort.patch: patches/build_llama.sh)"
        )
    return True, ""


class Servers:
    """The devices of a load's RPC servers (and this host's GPUs, which an explicit device list
    would otherwise leave out), as the NULL-terminated array llama_model_params.devices takes."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"options.rpcServers: {why}")
        g = self.g = _Ggml()
        reg = g.reg_by_name(b"RPC")
        add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(g.proc_address(reg, b"ggml_backend_rpc_add_server"))
        self._failed = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_char_p)(
            g.proc_address(reg, b"ggml_backend_rpc_endpoint_failed")
        )
        self.endpoints = tuple(endpoints)
        with _lock:
            busy = {e for e in self.endpoints if _in_use.get(e)}
        for endpoint in self.endpoints:
            if endpoint not in busy:  # this process's connection to it is already up
                probe(endpoint)
        local = [d for d in range(g.dev_count()) if g.dev_type(g.dev_get(d)) in _GPU_TYPES] if g.dev_count else []
        devices = [g.dev_get(d) for d in local]
        self.names: dict[str, str | None] = {}
        os.environ.setdefault("GGML_RPC_TIMEOUT", TIMEOUT_SECONDS)  # read by ggml when it connects
        for endpoint in self.endpoints:
            server = add(endpoint.encode())
            if not server or self._failed(endpoint.encode()):
                raise ConnectionError(f"the RPC server {endpoint} cannot be reached or has no devices")
            for i in range(g.reg_dev_count(server)):
                dev = g.reg_dev_get(server, i)
                devices.append(dev)
                self.names[(g.dev_name(dev) or b"").decode()] = endpoint
        with _lock:
            for endpoint in self.endpoints:
                _in_use[endpoint] = _in_use.get(endpoint, 0) + 1
        self._released = False
        self.count = len(devices)
        self.array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)

    def check(self) -> None:
        """RuntimeError naming a server whose connection failed (the model cannot go on)."""
        for endpoint in self.endpoints:
            if self._failed(endpoint.encode()):
                raise RuntimeError(
                    f"the RPC server {endpoint} failed (it cannot be reached, it closed the connection or it did "
                    f"not answer for {os.environ.get('GGML_RPC_TIMEOUT', TIMEOUT_SECONDS)} s): "
                    "the model's layers there are gone"
                )

    def release(self) -> None:
        if not self._released:
            self._released = True
            with _lock:
                for endpoint in self.endpoints:
                    _in_use[endpoint] = max(0, _in_use.get(endpoint, 0) - 1)


_GPU_TYPES = (buft.DEVICE_GPU, buft.DEVICE_IGPU)

# llama.cpp's log lines saying where each layer went, collected per loading thread.
_capture: dict[int, list[str]] = {}


def capture_start() -> None:
    _capture[threading.get_ident()] = []


def capture_line(text: str) -> None:
    lines = _capture.get(threading.get_ident())
    if lines is not None and "assigned to device" in text:
        lines.append(text)


def capture_end(names: dict[str, str | None], n_layer: int) -> tuple[dict[str, Any], ...]:
    """The load's layer map from the captured lines: ({"device", "server", "layers": [[a, b], ...]}),
    in order of each device's first layer."""
    import re

    lines = _capture.pop(threading.get_ident(), [])
    where: dict[str, list[int]] = {}
    for line in lines:
        m = re.search(r"layer\s+(\d+) assigned to device (\S+?),", line)
        if m and int(m.group(1)) <= n_layer:
            where.setdefault(m.group(2), []).append(int(m.group(1)))
    out = []
    for device, layers in sorted(where.items(), key=lambda kv: min(kv[1])):
        ranges: list[list[int]] = []
        for n in sorted(set(layers)):
            if ranges and ranges[-1][1] == n - 1:
                ranges[-1][1] = n
            else:
                ranges.append([n, n])
        out.append({"device": device, "server": names.get(device), "layers": ranges})
    return tuple(out)
