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
import stat
from collections.abc import Iterator
from pathlib import Path

from kinfer_rpc.host.store import kinfer_home

SOCKET_NAME = "kinfer.sock"
LOCK_NAME = "kinfer.lock"


def default_socket() -> Path:
    """$XDG_RUNTIME_DIR/kinfer/kinfer.sock, else $KINFER_HOME/run/kinfer.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "kinfer" / SOCKET_NAME
    return kinfer_home() / "run" / SOCKET_NAME


class Unsafe(Exception):
    """The socket's folder is not one only this user can reach."""


def own_folder(folder: Path) -> None:
    """Make `folder` (0700) or check it is a real directory of this user that nobody else can
    enter: never a symbolic link, never group- or world-accessible."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{folder} is not a directory (a symbolic link?)")
    if st.st_uid != os.getuid():
        raise Unsafe(f"{folder} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)  # our own folder, made loose by someone: tighten it


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
    own_folder(path.parent)
    fd = os.open(path.parent / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
