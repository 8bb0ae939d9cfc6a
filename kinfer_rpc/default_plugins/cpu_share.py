"""How many CPU threads a CPU-only llama load should compute with now, from what the machine's other
processes are doing.

llama.cpp's workers wait for each other between operations by spinning; with as many threads as
cores and another process busy on one of them, every operation waits for the thread that the
other process keeps off its core, and generation runs several times slower than on fewer threads
(docs/performance.md, "CPU threads under load"). So a load that names no thread count looks, at
most twice a second, at how busy the cores are with other processes (/proc/stat, less this
process's own time from /proc/self/stat) and computes with the cores left over, at least one.
Which thread computes which part of an operation never changes a result on the CPU (each output
element is one thread's), so replies stay the same.
"""

from __future__ import annotations

import os
import time

INTERVAL = 0.5  # seconds between two looks at the machine


def _machine() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs together, from /proc/stat's first line."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _own() -> int | None:
    """This process's user and system jiffies (every thread's)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def _cpus_in_stat() -> int:
    try:
        with open("/proc/stat") as f:
            return sum(1 for line in f if line.startswith("cpu") and line[3:4].isdigit())
    except OSError:
        return 0


class CpuShare:
    """The thread count to use now, between 1 and `most`: the cores other processes leave free."""

    def __init__(self, most: int):
        self.most = most
        self.threads = most
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        # Only where /proc/stat counts the cores this process may use (not a container's slice of
        # a larger host, whose other tenants' load is not ours to read).
        self.cpus = usable if _cpus_in_stat() == usable else 0
        self._last: tuple[float, tuple[int, int], int] | None = None
        self._look()

    def _look(self) -> float | None:
        """The cores other processes kept busy since the last look (None the first time)."""
        machine, own = _machine(), _own()
        if machine is None or own is None:
            self.cpus = 0
            return None
        now = time.monotonic()
        last, self._last = self._last, (now, machine, own)
        if last is None:
            return None
        total = machine[1] - last[1][1]
        if total <= 0:
            return None
        others = (machine[0] - last[1][0]) - (own - last[2])
        return max(0.0, others / total * self.cpus)

    def now(self) -> int:
        """The thread count for the next pass (looks at the machine at most every INTERVAL)."""
        if not self.cpus or self.most <= 1:
            return self.threads
        last = self._last
        if last is not None and time.monotonic() - last[0] < INTERVAL:
            return self.threads
        busy = self._look()
        if busy is not None:
            self.threads = max(1, min(self.most, int(self.cpus - busy + 0.5)))
        return self.threads
