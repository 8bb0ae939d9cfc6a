"""`kinfer serve --http` on a free loopback port with a KINFER_HOME of its own, for the tests of
the HTTP faces and of what runs on them (agent frameworks, the docs' examples)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kinfer_rpc.client import Client

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """`kinfer serve --http` on a free loopback port, its own KINFER_HOME."""

    def __init__(self, home: Path, *extra: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.socket = home / "run" / "kinfer.sock"
        self.env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        self.env.update(KINFER_HOME=str(home), KINFER_MODELS=str(home / "models"), OLLAMA_MODELS=str(home / "ollama"))
        self.env.update(env or {})
        self.log = open(home / "serve.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(BIN / "kinfer"), "serve", "--socket", str(self.socket), "--http", f"127.0.0.1:{self.port}", *extra],
            env=self.env,
            stdout=self.log,
            stderr=self.log,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                if httpx.get(self.url + "/", timeout=1).status_code in (200, 401):  # 401: it wants a key
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.proc.kill()  # never left behind by a test that failed here
        self.proc.wait(10)
        raise AssertionError("the HTTP face did not answer")

    def status(self) -> list[dict]:
        with Client([str(BIN / "kinfer-rpc"), "--attach", "--socket", str(self.socket)], env=self.env) as c:
            return c.request("model/status", {})["models"]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.log.close()
        return code
