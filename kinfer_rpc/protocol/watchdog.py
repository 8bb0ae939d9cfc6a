"""What ends the server when its event loop cannot: a daemon thread that notices the client's or
the parent's death and SIGINT, SIGTERM and SIGHUP, and makes sure the process ends.

The server ends gracefully on its event loop (every request in flight answered -32800 with its
partial result, the models unloaded, the queued messages written). A loop held by a request, or a
shutdown stuck on a worker, would keep the process alive indefinitely; so whatever starts the end
(these causes, the end of stdin, `exit`, stdout gone) also arms a deadline, and the process that
has not ended GRACE seconds later is ended here with the same exit code.

Signals reach this thread without the loop: the C-level handler Python installs writes the
signal's number to a pipe (signal.set_wakeup_fd) that this thread reads, whichever thread the
signal interrupted and whatever the main thread is doing. The thread is Python, so a native call
that holds the GIL for longer (none of kinfer's does) would delay it as much.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

GRACE = 1.5  # seconds the graceful end may take, from its cause, before the process is ended
TICK = 0.2  # seconds between two checks of the client's and the parent's process
# SIGHUP: the terminal the server was started from closed (no such signal on Windows).
SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Watchdog:
    """Watches for the causes that end the server from outside and ends the process when the
    graceful end does not.

    `stop(code, why)` asks the server to end gracefully (called on this thread: it must hand
    over to the loop); `client_pid()` is the client's process id once known; `exit_code()` the
    code the server decided on, if any, which wins over the code given to arm()."""

    def __init__(
        self,
        stop: Callable[[int, str], None],
        client_pid: Callable[[], int | None],
        exit_code: Callable[[], int | None],
        *,
        grace: float = GRACE,
        tick: float = TICK,
    ):
        self._stop = stop
        self._client_pid = client_pid
        self._exit_code = exit_code
        self.grace = grace
        self.tick = tick
        self.parent_pid = os.getppid()
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._code = 1
        self._done = threading.Event()
        self._stopped = False
        self._signals_r, self._signals_w = os.pipe()
        os.set_blocking(self._signals_w, False)
        self._thread = threading.Thread(target=self._run, name="kinfer-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def catch_signals(self) -> None:
        """SIGINT, SIGTERM and SIGHUP come to this thread (call from the main thread, where
        Python allows it; elsewhere the signals keep their handling)."""
        try:
            signal.set_wakeup_fd(self._signals_w, warn_on_full_buffer=False)
            for signum in SIGNALS:
                signal.signal(signum, _ignore)  # the C handler writes the number to the pipe
        except ValueError:
            log.debug("not the main thread: signals are left alone")

    def arm(self, code: int) -> None:
        """The end has begun: unless the process has ended GRACE seconds from now, end it with
        the server's exit code (or `code` if it has none). Only the first call counts. Any thread."""
        with self._lock:
            if self._deadline is None and not self._done.is_set():
                self._deadline = time.monotonic() + self.grace
                self._code = code

    def close(self) -> None:
        """The server has ended on its own: stand down."""
        self._done.set()

    def _run(self) -> None:
        while not self._done.is_set():
            wait = self.tick
            with self._lock:
                deadline = self._deadline
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
                if wait <= 0.0:
                    self._end_now()
                    return
            try:
                ready, _, _ = select.select([self._signals_r], [], [], wait)
            except OSError:  # Windows: select takes sockets only (the process watch still runs)
                ready = []
                time.sleep(wait)
            if ready:
                for signum in os.read(self._signals_r, 64):
                    self._begin(128 + signum, f"{_name(signum)}: answering the requests in flight and exiting")
            self._check_processes()

    def _check_processes(self) -> None:
        pid = self._client_pid()
        if pid and not alive(pid):
            self._begin(1, f"the client process {pid} died; exiting")
        # Without a process id, the parent: when it dies the server is re-parented (to init or a
        # subreaper), and a stdin left open by some other process would keep it alive.
        elif not pid and os.getppid() != self.parent_pid:
            self._begin(1, f"the parent process {self.parent_pid} died; exiting")

    def _begin(self, code: int, why: str) -> None:
        if self._stopped:
            return
        self._stopped = True
        log.warning("%s", why)
        self.arm(code)
        self._stop(code, why)

    def _end_now(self) -> None:
        if self._done.is_set():
            return
        code = self._exit_code()
        code = self._code if code is None else code
        message = f"kinfer-rpc: the server did not end within {self.grace:g} s; exiting with code {code}\n"
        try:
            os.write(2, message.encode())  # not through logging: its locks may be held by a stuck thread
        except OSError:
            pass
        os._exit(code)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler of the signals this thread takes (see catch_signals)."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
