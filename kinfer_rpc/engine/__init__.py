"""The engine layer: one loaded model's scheduler. Jobs, slots and their KV cells, the pass in
flight, planning, token choosing, drafting and text streaming, on one worker thread that owns the
device. Knows nothing of JSON."""

import os

# The cores this process may run on (a container or taskset may allow fewer than the machine has).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
