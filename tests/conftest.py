import os
import sys

import pytest

# llama.cpp's OpenMP workers spin while waiting; on a shared 2-core machine that makes every
# model in the suite (in-process or a spawned server) many times slower. Set before any load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Test helpers (rpcclient, engine_helpers, reliability_helpers...) and the model generators
# (modelgen/make_*.py, also run as scripts) are imported as plain modules.
sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "modelgen")]

# kinfer's patched llama.cpp (patches/build_llama.sh, run by the README's test command): load it
# instead of the wheel's library where it was built.
_PATCHED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".llama", "lib")
if os.path.exists(os.path.join(_PATCHED, "libllama.so")) and "LLAMA_CPP_LIB_PATH" not in os.environ:
    os.environ["LLAMA_CPP_LIB_PATH"] = _PATCHED
    os.environ["KINFER_TESTS_ON_PATCHED_LLAMA"] = "1"

from reliability_helpers import no_traceback  # noqa: E402  (after the path and environment above)
from rpcclient import RpcClient  # noqa: E402

# -- fixtures shared by several test modules ---------------------------------------------------


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """One initialized server that never loads a model, with empty model stores."""
    root = tmp_path_factory.mktemp("bare")
    env = {
        "KINFER_MODELS": str(root / "kinfer"),
        "OLLAMA_MODELS": str(root / "ollama"),
        "KINFER_HOME": str(root / "home"),
    }
    c = RpcClient.spawn(env=env)
    try:
        c.initialize()
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    no_traceback(c)
