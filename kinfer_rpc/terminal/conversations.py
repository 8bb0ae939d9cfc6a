"""Conversations saved by name (`/save NAME`, `/load NAME` in `kinfer chat`), one JSON file each
in $KINFER_HOME/conversations.

A name is a word of letters, digits, `.`, `_` and `-` (so it is never a path, and never a model
name with its `:` or `/`). Files are written safely: into a temporary file of their own in the
folder, synced, then renamed over the old one, so a crash leaves the old conversation or the new,
never half of one; the folder is made 0700 and the files 0600; a symbolic link is never followed,
neither as the folder nor as a file (the folder is opened once with O_NOFOLLOW and every file
operation is relative to it)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from kinfer_rpc.types import kinfer_home

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_BYTES = 64 << 20  # a saved conversation larger than this is not read
VERSION = 1


class ConversationError(Exception):
    """A name that is not a conversation's, a file that cannot be read or written; the message
    says which and why."""


@attrs.frozen
class Conversation:
    model: str
    system: str | None
    options: dict[str, Any]
    messages: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "model": self.model,
            "system": self.system,
            "options": self.options,
            "messages": self.messages,
        }


def folder() -> Path:
    return kinfer_home() / "conversations"


def valid(name: str) -> bool:
    return NAME.fullmatch(name) is not None


def _check(name: str) -> str:
    if not valid(name):
        raise ConversationError(
            f"{name!r} is not a conversation's name: use letters, digits, '.', '_' and '-' "
            "(at most 64, beginning with a letter or digit)"
        )
    return name + ".json"


@contextlib.contextmanager
def _folder(create: bool) -> Iterator[int]:
    """The folder's descriptor, opened without following a link."""
    path = folder()
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ConversationError("no conversation has been saved yet (/save NAME saves one)") from None
    except OSError as exc:
        raise ConversationError(f"{path} cannot be used (a symbolic link is not followed): {exc.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def save(name: str, conversation: Conversation) -> Path:
    """Write the conversation under `name`, replacing one saved before; its path."""
    file = _check(name)
    data = json.dumps(conversation.to_json(), ensure_ascii=False, indent=1).encode()
    with _folder(create=True) as fd:
        temp = f".{name}.{os.getpid()}.tmp"
        try:
            out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
                os.fsync(out)
            finally:
                os.close(out)
            os.replace(temp, file, src_dir_fd=fd, dst_dir_fd=fd)  # a link named `file` is replaced, not followed
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
            raise ConversationError(f"cannot save {name!r}: {exc.strerror or exc}") from None
    return folder() / file


def load(name: str) -> Conversation:
    """The conversation saved under `name`."""
    file = _check(name)
    with _folder(create=False) as fd:
        try:
            handle = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except FileNotFoundError:
            raise ConversationError(f"no conversation named {name!r} (saved: {', '.join(names()) or 'none'})") from None
        except OSError as exc:
            raise ConversationError(f"cannot read {name!r}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(handle).st_mode):  # a FIFO would block the read forever
            os.close(handle)
            raise ConversationError(f"cannot read {name!r}: not a regular file")
        with os.fdopen(handle, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConversationError(f"{name!r} is larger than {MAX_BYTES >> 20} MiB")
    try:
        doc = json.loads(data)
        return _conversation(doc)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConversationError(f"{folder() / file} is not a saved conversation: {exc}") from None


def exists(name: str) -> bool:
    if not valid(name):
        return False
    try:
        with _folder(create=False) as fd:
            os.stat(name + ".json", dir_fd=fd, follow_symlinks=False)
            return True
    except (ConversationError, OSError):
        return False


def names() -> list[str]:
    """The saved conversations' names, sorted."""
    try:
        with _folder(create=False) as fd:
            entries = os.listdir(fd)
    except (ConversationError, OSError):
        return []
    return sorted(e[: -len(".json")] for e in entries if e.endswith(".json") and valid(e[: -len(".json")]))


def _conversation(doc: Any) -> Conversation:
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} conversation")
    model, system, options, messages = doc["model"], doc.get("system"), doc.get("options") or {}, doc["messages"]
    if not isinstance(model, str) or not (system is None or isinstance(system, str)) or not isinstance(options, dict):
        raise ValueError("model, system or options of the wrong type")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
        for m in messages
    ):
        raise ValueError("messages must be a list of {role, content}")
    return Conversation(model, system, options, messages)
