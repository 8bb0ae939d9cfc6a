"""Real terminals for the tests: tmux sessions running `kinfer chat`, and what to read off them."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cli_helpers import BIN

_HOME = tempfile.mkdtemp(prefix="kinfer-home-")


def env() -> dict[str, str]:
    """A terminal's environment: kinfer on PATH, its own KINFER_HOME (the chat's history and the
    store's notes, not the user's), no KINFER_RPC of the test run."""
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see tests/conftest.py
    e.pop("KINFER_RPC", None)
    e.setdefault("KINFER_HOME", _HOME)
    return e


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


# -- `kinfer chat` in a real terminal (tmux) -----------------------------------------------------
def tmux_binary() -> str | None:
    """tmux, installed with apt-get where it is missing and this user may."""
    if shutil.which("tmux") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        apt = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "tmux"]
        if subprocess.run(install, env=apt, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=apt, capture_output=True, timeout=600)
            subprocess.run(install, env=apt, capture_output=True, timeout=600)
    return shutil.which("tmux")


class Tmux:
    """A tmux server of our own (its own socket): one window running one command."""

    def __init__(self, tmux: str, folder: Path):
        self.tmux, self.socket = tmux, str(folder / "tmux.sock")
        conf = folder / "tmux.conf"
        conf.write_text("set -g remain-on-exit on\nset -g history-limit 10000\n")
        self.conf = str(conf)

    def __call__(self, *args: str) -> str:
        proc = subprocess.run(
            [self.tmux, "-S", self.socket, "-f", self.conf, *args],
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, f"tmux {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def start(self, command: str, width: int = 160) -> int:
        self("new-session", "-d", "-x", str(width), "-y", "40", "-s", "t", command)
        self.pid = int(self.pane("pane_pid"))
        return self.pid

    def restart(self, command: str, width: int = 160) -> int:
        """Another command in a fresh terminal, once the last one's tmux server has gone."""
        self.close()

        def gone() -> bool:
            probe = [self.tmux, "-S", self.socket, "has-session"]
            return subprocess.run(probe, capture_output=True, timeout=30).returncode != 0

        wait_until(gone, 10, "tmux to exit")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)  # a server that is gone: its socket would only refuse
        return self.start(command, width)

    def pane(self, field: str) -> str:
        return self("display-message", "-p", "-t", "t", f"#{{{field}}}").strip()

    def screen(self, joined: bool = True) -> str:
        """The whole pane, its history too, lines joined where they wrapped (`joined`) or as
        the terminal shows them."""
        text = self("capture-pane", "-p", *(["-J"] if joined else []), "-S", "-", "-t", "t")
        return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", "t", *keys)

    def wait_for(self, predicate: Callable[[str], bool], what: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the terminal shows:\n{screen}")
            time.sleep(0.2)

    def dead(self) -> bool:
        """The command ended, and tmux knows how (its exit status or its signal)."""
        return self.pane("pane_dead") == "1" and self.exit() != ""

    def exit(self) -> str:
        """The ended command's exit status, or "signal N". tmux may be slow to reap it: then the
        zombie's /proc stat holds it (field 52, as waitpid reports it)."""
        status, signum = self.pane("pane_dead_status"), self.pane("pane_dead_signal")
        if status or signum:
            return status or f"signal {signum}"
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return ""  # reaped meanwhile: tmux has it now
        if fields[0] != "Z":
            return ""
        code = os.waitstatus_to_exitcode(int(fields[49]))
        return str(code) if code >= 0 else f"signal {-code}"

    def close(self) -> None:
        subprocess.run([self.tmux, "-S", self.socket, "kill-server"], capture_output=True, timeout=30)


def last_line(screen: str) -> str:
    lines = screen.splitlines()
    return lines[-1] if lines else ""


def at_prompt(screen: str) -> bool:
    return last_line(screen) == ">>>"


def answer(term: Tmux, command: str, text: str, timeout: float = 60) -> str:
    """Type a command, wait for `text` in what follows it and for the prompt back; return what
    followed the command."""
    marker = f">>> {command}\n"
    before = term.screen().count(marker)
    typed(term, command)
    screen = term.wait_for(
        lambda s: s.count(marker) > before and text in s.rsplit(marker, 1)[1] and at_prompt(s), repr(text), timeout
    )
    return screen.rsplit(marker, 1)[1]


def typed(term: Tmux, *lines: str) -> None:
    for line in lines:
        term.keys("-l", line)
        term.keys("Enter")
