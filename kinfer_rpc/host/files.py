"""kinfer's own files under $KINFER_HOME, handled as a careful daemon handles them.

- Folders kinfer writes in (`run`, `conversations`, the model cache) are real directories of
  this user that nobody else can enter: made 0700, never a symbolic link, never another user's;
  a loose one of ours is tightened (`private_dir`).
- Files are written whole: into a temporary file of their own, created with O_EXCL and
  O_NOFOLLOW (0600) in the checked folder, synced, then renamed over the old one, every step
  relative to the folder's descriptor, so a link planted at either name is never followed and a
  crash leaves the old file or the new (`write_private`).
- Files are read only when they are regular files of bounded size: opened with O_NONBLOCK (a
  FIFO would block a reader forever) and checked with fstat before the first byte; a device such
  as /dev/zero or a file over the limit is refused unread (`read_regular`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class Unsafe(OSError):
    """A folder or file that is not what kinfer may trust: a link, another user's, not a regular
    file; the message says which and why."""


def private_dir(folder: Path, create: bool = True) -> Path:
    """`folder`, made (0700; its parents as the umask says) or checked: a real directory of this
    user, not a symbolic link, that only this user can enter (tightened when it is ours and
    loose). Unsafe otherwise; FileNotFoundError when it is missing and `create` is false."""
    if create:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{folder} is not a directory (a symbolic link?)")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise Unsafe(f"{folder} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)  # our own folder, made loose by someone: tighten it
    return folder


@contextlib.contextmanager
def _opened(folder: Path, follow: bool = False) -> Iterator[int]:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | (0 if follow else _NOFOLLOW) | _CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes, sync: bool = True) -> None:
    """Replace `path` with `data`, whole, as described above (0600, in a private folder)."""
    write_whole(path, data, sync, private=True)


def write_whole(path: Path, data: bytes, sync: bool = True, private: bool = False) -> None:
    """Replace `path` with `data`, whole: a temporary file of its own (O_EXCL, O_NOFOLLOW),
    synced, renamed over `path` relative to the folder's descriptor, so no link at either name
    is followed. `private`: 0600 in a folder `private_dir` checks; else as the umask says, in a
    folder made as needed (a model store may be shared, or a link to another disk)."""
    if private:
        folder = private_dir(path.parent)
    else:
        folder = path.parent
        folder.mkdir(parents=True, exist_ok=True)
    with _opened(folder, follow=not private) as dir_fd:
        temp = f".{path.name}.{secrets.token_hex(6)}.tmp"
        mode = 0o600 if private else 0o666
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(temp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise


def read_regular(path: Path, limit: int, follow: bool = True) -> bytes:
    """At most `limit` bytes of the regular file at `path`. A FIFO, a device, a directory, a file
    longer than `limit` (whatever anything declares of it) or, with `follow` false, a symbolic
    link is refused unread (OSError)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW))
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise Unsafe(f"{path} is a symbolic link") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unsafe(f"{path} is not a regular file")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise Unsafe(f"{path} is larger than {limit} bytes")
    return b"".join(chunks)


def regular_or_absent(path: Path) -> bool:
    """Whether `path` is missing or a regular file that is not a link (a file kinfer may replace
    or have a library write by name)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    return stat.S_ISREG(st.st_mode)
