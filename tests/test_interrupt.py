"""Ctrl-C at a terminal: it stops a reply, never the server.

A terminal sends SIGINT to its whole foreground process group. A client that spawned
`kinfer-rpc` in its own group would have the server die with it; the clients spawn the server in
a session of its own, and the client side cancels the reply ($/cancelRequest). Driven as a person
or a script meets it: `kinfer chat` in a real terminal (tmux, C-c), and a Python script using
Client on a pseudo-terminal (\\x03). The Node and Neovim clients have their own tests
(clients/node/test/, tests/test_nvim.py).
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from cli_helpers import KINFER
from tmux_helpers import Tmux, at_prompt, env, last_line, tmux_binary, wait_until

from kinfer_rpc.client import AsyncClient, Client

LONG = "Count from 1 to 500, one number per line."


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- the spawned server's process group ----------------------------------------------------------
def test_the_clients_spawn_the_server_in_a_session_of_its_own():
    with Client(env=env()) as kinfer:
        assert os.getsid(kinfer.pid) == kinfer.pid != os.getsid(0)
        assert os.getpgid(kinfer.pid) != os.getpgid(0)

    async def main() -> None:
        async with AsyncClient(env=env()) as kinfer:
            assert os.getsid(kinfer.pid) == kinfer.pid != os.getsid(0)
            assert os.getpgid(kinfer.pid) != os.getpgid(0)

    anyio.run(main)


# -- a Python script on a terminal ---------------------------------------------------------------
class Terminal:
    """A program on a pseudo-terminal of its own (its controlling terminal): what it prints, and
    keys typed at it (\\x03 is Ctrl-C: the terminal sends SIGINT to its foreground group)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | Path):
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once
            try:
                os.chdir(cwd)
                # As a terminal's shell starts a program: Ctrl-C's signal not ignored, whatever
                # this process inherited (a job started with `&` outside job control ignores it).
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.output, self.status = pid, fd, b"", None

    def read(self, timeout: float) -> bool:
        """Read what came within `timeout`; False at the end of the output."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the other side is closed
            data = b""
        self.output += data
        return bool(data)

    def expect(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.output:
            if time.monotonic() > deadline or not self.read(0.2):
                raise AssertionError(f"{text!r} never came; the terminal shows:\n{self.text}")

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.read(0.2) and time.monotonic() < deadline:
            pass
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                raise AssertionError(f"the program did not end; the terminal shows:\n{self.text}")
            else:
                time.sleep(0.1)
        os.close(self.fd)
        return self.status

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


SCRIPT = r"""
import time

from kinfer_rpc.client import Client

with Client() as kinfer:
    kinfer.load(threads=1)
    print("server", kinfer.pid, flush=True)
    # The with block: Ctrl-C may land between two pieces, outside the stream's own code;
    # leaving the block unfinished cancels the request either way.
    with kinfer.stream_generate("Count to a thousand.", maxTokens=5000, ignoreEos=True, temperature=0) as stream:
        try:
            for n, piece in enumerate(stream):
                if n == 3:
                    print("streaming", flush=True)
            print("the stream ran to its end", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    answer = stream.response.result(30)  # the server's answer to the cancelled request
    print("answered", answer["error"]["code"], answer["error"]["data"]["usage"]["completionTokens"] > 0, flush=True)
    time.sleep(1)  # a while later, the next question
    reply = kinfer.generate("Hello", maxTokens=2, temperature=0)
    print("then", reply.usage.completion_tokens, "tokens from", kinfer.pid, flush=True)
    print("exit code", kinfer.close(), flush=True)
"""


BARE_LOOP = r"""
import time

from kinfer_rpc.client import Client

with Client() as kinfer:
    kinfer.load(threads=1)
    print("server", kinfer.pid, flush=True)
    # A bare loop whose body takes the time: Ctrl-C lands in the body, outside the stream's code,
    # and `stream` keeps the stream alive (it is never collected while the script runs).
    stream = kinfer.stream_generate("Count to a thousand.", maxTokens=5000, ignoreEos=True, temperature=0)
    try:
        for n, piece in enumerate(stream):
            time.sleep(0.05)
            if n == 3:
                print("streaming", flush=True)
        print("the stream ran to its end", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    answer = stream.response.result(30)
    print("answered", answer["error"]["code"], flush=True)
    reply = kinfer.generate("Hello", maxTokens=2, temperature=0)
    print("then", reply.usage.completion_tokens, "tokens from", kinfer.pid, flush=True)
    print("exit code", kinfer.close(), flush=True)
"""


@pytest.mark.model
def test_ctrl_c_in_a_bare_loop_body_cancels_the_stream_too(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(BARE_LOOP)
    term = Terminal([sys.executable, str(script)], env(), tmp_path)
    term.expect("streaming")
    server = int(term.text.split("server ", 1)[1].split()[0])
    term.type(b"\x03")
    assert term.wait() == 0, term.text
    assert "interrupted" in term.text and "answered -32800" in term.text, term.text
    assert f"then 2 tokens from {server}" in term.text and "Traceback" not in term.text, term.text


@pytest.mark.model
def test_ctrl_c_in_a_script_stops_the_stream_and_keeps_the_server(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    term = Terminal([sys.executable, str(script)], env(), tmp_path)
    term.expect("streaming")
    server = int(term.text.split("server ", 1)[1].split()[0])
    term.type(b"\x03")
    assert term.wait() == 0 and "SIGINT" not in term.text, term.text
    assert "interrupted" in term.text
    assert "answered -32800 True" in term.text  # cancelled, with its partial result
    assert f"then 2 tokens from {server}" in term.text  # the same server answered the next request
    assert "exit code 0" in term.text and "Traceback" not in term.text, term.text


@pytest.fixture
def tmux(tmp_path):
    binary = tmux_binary()
    if binary is None:
        pytest.skip("tmux is not installed and could not be installed (apt-get install tmux)")
    t = Tmux(binary, tmp_path)
    try:
        yield t
    finally:
        t.close()


def server_of(client_pid: int) -> int:
    """The kinfer-rpc that `client_pid` spawned, as `kinfer ps` shows it."""
    proc = subprocess.run([KINFER, "ps", "--json"], capture_output=True, text=True, env=env(), timeout=60)
    (pid,) = [s["pid"] for s in json.loads(proc.stdout) if s["ppid"] == client_pid]
    return int(pid)


def lines_after(screen: str, marker: str) -> list[str]:
    return screen[screen.rindex(marker) + len(marker) :].splitlines()[1:]


@pytest.mark.model
def test_ctrl_c_in_kinfer_chat_stops_the_reply_and_keeps_the_server(tmux):
    chat = tmux.start(f"exec {KINFER} chat --threads 1 --temperature 0 --max-tokens 3000")
    tmux.wait_for(at_prompt, "the prompt")
    server = server_of(chat)

    # Ctrl-C during a long reply: the reply stops, the prompt comes back.
    tmux.keys(LONG, "Enter")
    tmux.wait_for(lambda s: LONG in s and len(lines_after(s, LONG)) >= 3, "the reply")
    tmux.keys("C-c")
    screen = tmux.wait_for(at_prompt, "the prompt after Ctrl-C", timeout=30)
    assert "to leave)" not in screen, screen  # it came during the reply, not at the prompt
    assert alive(server) and server_of(chat) == server

    # The same server answers the next question.
    tmux.keys("Name a colour in one word.", "Enter")
    screen = tmux.wait_for(
        lambda s: "colour in one word." in s and at_prompt(s) and len(lines_after(s, "colour in one word.")) >= 2,
        "the second reply",
    )
    reply = lines_after(screen, "colour in one word.")[:-1]
    assert "".join(reply).strip() and "server exited" not in screen, screen
    assert alive(server) and server_of(chat) == server

    # At the prompt: Ctrl-C clears the line; a second one on an empty line leaves.
    tmux.keys("not to be sent")
    tmux.wait_for(lambda s: last_line(s) == ">>> not to be sent", "the typed line")
    tmux.keys("C-c")
    tmux.wait_for(lambda s: at_prompt(s) and "not to be sent" in s, "a fresh prompt")
    assert not tmux.dead()
    tmux.keys("C-c")
    time.sleep(0.5)
    assert not tmux.dead(), tmux.screen()  # the first Ctrl-C on an empty line only says how to leave
    tmux.keys("C-c")
    wait_until(tmux.dead, 30, "kinfer chat to leave")
    assert tmux.exit() == "0"
    wait_until(lambda: not alive(server), 30, "the server to exit")
    screen = tmux.screen()
    assert "Traceback" not in screen and "SIGINT" not in screen, screen


@pytest.mark.model
def test_ctrl_c_in_a_one_shot_kinfer_chat_stops_it_cleanly(tmux):
    # ignoreEos: the reply must still be running when Ctrl-C comes, however fast the machine
    chat = tmux.start(f"exec {KINFER} chat --threads 1 --temperature 0 --max-tokens 3000 -o ignoreEos true '{LONG}'")
    tmux.wait_for(lambda s: len([line for line in s.splitlines() if line.strip()]) >= 3, "the reply")
    server = server_of(chat)
    tmux.keys("C-c")
    wait_until(tmux.dead, 30, "kinfer chat to end")
    assert tmux.exit() == "130"
    wait_until(lambda: not alive(server), 30, "the server to exit")
    screen = tmux.screen()
    assert "Traceback" not in screen and "SIGINT" not in screen, screen
