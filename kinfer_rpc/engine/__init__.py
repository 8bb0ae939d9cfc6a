"""The engine layer: one loaded model's scheduler. Jobs, slots and their KV cells, the pass in
flight, planning, token choosing, drafting and text streaming, on one worker thread that owns the
device. Knows nothing of JSON."""

import os

# The cores this process may run on (a container or taskset may allow fewer than the machine has).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

# Work still running this long (a render, a schema's compile) moves to idle CPU time (below).
IDLE_AFTER_SECONDS = 0.25


def on_idle_cpu(task: int) -> bool:
    """Thread or process `task` runs from now on only on CPU time nothing else wants (Linux's
    SCHED_IDLE; a thread id names the thread alone). Whether it took effect."""
    idle = getattr(os, "SCHED_IDLE", None)  # Linux only
    if idle is None:
        return False
    try:
        os.sched_setscheduler(task, idle, os.sched_param(0))
    except OSError:
        return False
    return True
