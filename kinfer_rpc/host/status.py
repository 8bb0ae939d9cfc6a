"""A server's state for `kinfer ps`: `$KINFER_HOME/run/<pid>.json`, one file a server.

Each server answers only its own client, so what it is doing is written where other processes on
the machine can read it: {pid, startedAt, models: [{name, state (loading | ready | failed),
slotsBusy, slots, queued}], requestsRunning, updatedAt}. The file is replaced whole
(host/files.py: a temporary file of its own, never through a link, in a 0700 folder of this
user), at most every half second and only when something changed, and removed at exit. Writing
it never raises: the first failure is logged at debug, and the server goes on without it.
Readers take only regular files of at most MAX_BYTES (a FIFO or a link planted in the folder is
skipped, never waited on), and remove the files of processes that are gone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kinfer_rpc.host.files import Unsafe, private_dir, read_regular, write_private
from kinfer_rpc.host.store import kinfer_home

if TYPE_CHECKING:
    from kinfer_rpc.host.runtime import Runtime

log = logging.getLogger(__name__)

INTERVAL = 0.5  # seconds between looks at the runtime (and the least between two writes)
MAX_BYTES = 1 << 20  # a status file is a few hundred bytes


def run_dir() -> Path:
    return kinfer_home() / "run"


def models(runtime: Runtime) -> list[dict[str, Any]]:
    """What model/status says of each model, in short: its state and its slots."""
    out: list[dict[str, Any]] = [
        {"name": name, "state": "failed", "slotsBusy": 0, "slots": 0, "queued": 0} for name in list(runtime.failed)
    ]
    for entry in list(runtime.loaded.values()):
        if not entry.ready.is_set() or entry.error is not None:
            out.append({"name": entry.name, "state": "loading", "slotsBusy": 0, "slots": 0, "queued": 0})
            continue
        # The numbers Engine.stats() gives model/status, read without it: stats() also asks the
        # backend for its memory (a native call), not something to do every half second while a
        # model may be unloading.
        engine = entry.engine
        model = engine.model
        expires = entry.expires()
        out.append(
            {
                "name": entry.name,
                "state": "ready",
                "slotsBusy": len(engine._active),
                "slots": model.info.slots if model is not None else 0,
                "queued": len(engine._queue),
                "holders": len(entry.holders),
                "pinned": entry.pinned,
                # seconds until it is unloaded for being idle; None: never (pinned, busy, kept)
                "expiresIn": round(max(0.0, expires - time.monotonic()), 1) if expires is not None else None,
            }
        )
    return out


class StatusFile:
    """The status file of this process."""

    def __init__(self, folder: Path | None = None, pid: int | None = None):
        self.pid = pid or os.getpid()
        self.started = round(time.time(), 3)
        self._folder = folder
        self._last: dict[str, Any] | None = None
        self._failed = False
        self._written = False

    @property
    def path(self) -> Path:
        return (self._folder or run_dir()) / f"{self.pid}.json"

    def update(self, models: list[dict[str, Any]], requests_running: int, daemon: dict[str, Any] | None = None) -> bool:
        """Write the file if what it says changed; True if it was written. `daemon`: the daemon's
        socket and open connections, when this process is one."""
        doc = {"pid": self.pid, "startedAt": self.started, "models": models, "requestsRunning": requests_running}
        if daemon is not None:
            doc["daemon"] = daemon
        if doc == self._last:
            return False
        self._last = doc
        try:
            data = json.dumps({**doc, "updatedAt": round(time.time(), 3)}).encode()
            write_private(self.path, data, sync=False)
            self._written = True
            return True
        except Exception as exc:  # noqa: BLE001 - the status is for `kinfer ps`, never worth failing for
            if not self._failed:
                log.debug("cannot write the status file %s: %s", self._folder or run_dir(), exc)
                self._failed = True
            self._last = None  # try again next time
            return False

    def remove(self) -> None:
        try:
            path = self.path
            path.unlink(missing_ok=True)
        except Exception as exc:  # noqa: BLE001
            log.debug("cannot remove the status file: %s", exc)
            return
        try:  # the last server out leaves no folder behind (another's file keeps it)
            path.parent.rmdir()
        except OSError:
            pass


def read_all(folder: Path | None = None) -> dict[int, dict[str, Any]]:
    """The status files of live processes, by pid; the files of dead ones are removed."""
    folder = folder or run_dir()
    found: dict[int, dict[str, Any]] = {}
    try:
        private_dir(folder, create=False)  # not a link, not another user's
        entries = list(folder.iterdir())
    except Unsafe as exc:
        log.warning("not reading the status files: %s", exc)
        return found
    except OSError:
        return found
    for entry in entries:
        stem = entry.name.removesuffix(".json")
        if not entry.name.endswith(".json") or not stem.isdigit():
            continue
        pid = int(stem)
        if not _alive(pid):
            try:
                entry.unlink(missing_ok=True)
            except OSError:
                pass
            continue
        try:
            doc = json.loads(read_regular(entry, MAX_BYTES, follow=False))
        except (OSError, ValueError):
            continue  # a FIFO, a link, a device or a damaged file: skipped, never waited on
        if isinstance(doc, dict) and doc.get("pid") == pid:
            found[pid] = doc
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
