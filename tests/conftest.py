import os
import sys

# llama.cpp's OpenMP workers spin while waiting; on a shared 2-core machine that makes every
# model in the suite (in-process or a spawned server) many times slower. Set before any load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Test helpers (test_engine's, rpcclient) import each other as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
