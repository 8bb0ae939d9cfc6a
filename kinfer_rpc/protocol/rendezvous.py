"""Where the daemon (kinfer serve) is found: its socket's path, whether a daemon answers there,
the lock that serializes starting one, and the checks on the socket's folder. Shared by the
daemon and the proxy that attaches to it (`kinfer-rpc --attach`), which starts one when none
answers."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from kinfer_rpc.host.files import private_dir
from kinfer_rpc.host.store import kinfer_home

SOCKET_NAME = "kinfer.sock"
LOCK_NAME = "kinfer.lock"


def default_socket() -> Path:
    """$XDG_RUNTIME_DIR/kinfer/kinfer.sock, else $KINFER_HOME/run/kinfer.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "kinfer" / SOCKET_NAME
    return kinfer_home() / "run" / SOCKET_NAME


def live(path: Path, timeout: float = 2.0) -> bool:
    """Whether a daemon answers on the socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                return False
            raise
        return True


@contextlib.contextmanager
def start_lock(path: Path) -> Iterator[None]:
    """The lock that serializes starting a daemon on `path` (kinfer.lock beside the socket)."""
    private_dir(path.parent)
    fd = os.open(path.parent / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
