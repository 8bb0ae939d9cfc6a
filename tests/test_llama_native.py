"""How llama.cpp's native libraries get into a process (kinfer_rpc/default_plugins/llama/native.py).

A llama.cpp whose libraries carry their own copy of the C++ runtime (-static-libstdc++) crashes
once another libstdc++.so.6 is in the process: on the H200 a prebuilt CUDA build segfaulted in
llama_model_load_from_file whenever numpy was imported first (its locale facet ids, GNU unique
symbols, bound to numpy's libstdc++). These tests build such a library and check that kinfer
refuses it with an error instead, through the protocol too, and that kinfer loads the ggml
libraries beside the libllama it was pointed at, whatever LD_LIBRARY_PATH says.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT
from rpcclient import RpcClient

from kinfer_rpc.default_plugins.llama import native as native

CXX = shutil.which("g++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no g++ to build a test library")
# Uses the locale machinery, as llama.cpp's print_info does through std::ostringstream.
SOURCE = (
    '#include <sstream>\nextern "C" int kinfer_test(long v) '
    "{ std::ostringstream s; s << v; return (int)s.str().size(); }\n"
)


def _build(folder: Path, static_runtime: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "t.cpp"
    src.write_text(SOURCE)
    out = folder / "libllama.so"
    flags = ["-static-libstdc++"] if static_runtime else []
    subprocess.run([CXX, "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True)
    return out


@needs_cxx
def test_a_library_with_its_own_cxx_runtime_is_told_from_one_that_shares_it(tmp_path):
    assert native.private_cxx_runtime(_build(tmp_path / "static", True))
    assert not native.private_cxx_runtime(_build(tmp_path / "shared", False))
    # The libraries kinfer runs on here (the wheel's, or patches/build_llama.sh's) share it.
    for lib in native._libraries(native.lib_dir()):
        assert not native.private_cxx_runtime(lib.resolve()), lib


@needs_cxx
def test_loading_a_private_runtime_after_libstdcxx_is_refused_not_crashed(tmp_path):
    import numpy  # noqa: F401  (loads libstdc++.so.6, as torch and other C++ extensions do)

    assert native.loaded_cxx_runtime()
    with pytest.raises(native.NativeLoadError, match="own copy of the C\\+\\+ runtime"):
        native.check(_build(tmp_path / "static", True).parent)
    assert native.check(_build(tmp_path / "shared", False).parent) == [tmp_path / "shared" / "libllama.so"]


@needs_cxx
def test_before_any_libstdcxx_a_private_runtime_may_load(tmp_path):
    folder = _build(tmp_path / "static", True).parent
    code = (
        "import sys; from kinfer_rpc.default_plugins.llama import native as n; from pathlib import Path; "
        "assert n.loaded_cxx_runtime() is None; print(len(n.check(Path(sys.argv[1]))))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


@needs_cxx
def test_the_server_answers_a_load_of_such_a_library_with_an_error_and_keeps_serving(tmp_path):
    folder = _build(tmp_path / "static", True).parent
    with RpcClient.spawn(env={"LLAMA_CPP_LIB_PATH": str(folder)}) as c:
        c.initialize()
        response = c.request("model/load", {}, timeout=60)
        assert response["error"]["code"] == -31003, response
        assert "C++ runtime" in response["error"]["message"]
        assert c.call("model/list", {})["models"]  # still serving
        c.call("shutdown")
        c.notify("exit")
        assert c.wait_exit(10) == 0


def test_the_ggml_beside_libllama_is_loaded_whatever_ld_library_path_says(tmp_path):
    """LLAMA_CPP_LIB_PATH's folder wins over another llama.cpp's folder in LD_LIBRARY_PATH."""
    ours = native.lib_dir()
    other = tmp_path / "other"
    other.mkdir()
    for lib in native._libraries(ours):  # a second copy, as another build's folder would be
        shutil.copy(lib.resolve(), other / lib.name)
    code = (
        "import json; from kinfer_rpc.default_plugins.llama import native as n; n.load(); "
        "print(json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libggml' in l})))"
    )
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(ours), "LD_LIBRARY_PATH": str(other)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    mapped = json.loads(out.stdout)
    assert mapped and all(Path(p).resolve().parent == ours.resolve() for p in mapped), mapped


def test_only_the_native_loader_imports_llama_cpp_at_module_level():
    """Any other module importing llama_cpp when it is imported would load llama.cpp past the check."""
    offenders = []
    for folder in ("kinfer_rpc", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "kinfer_rpc/default_plugins/llama/native.py":
                continue
            for node in ast.parse(path.read_text()).body:
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


# -- CPU threads from what the machine is doing (default_plugins.cpu_share) -------------------------
def test_the_thread_count_follows_the_cores_other_processes_leave(monkeypatch):
    from kinfer_rpc.default_plugins import cpu_share

    clock = [0.0]
    machine = [(0, 0)]  # (busy, total) jiffies of the whole machine
    own = [0]  # this process's jiffies
    monkeypatch.setattr(cpu_share, "_machine", lambda: machine[0])
    monkeypatch.setattr(cpu_share, "_own", lambda: own[0])
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock[0])
    share = cpu_share.CpuShare(2)
    share.cpus = 2  # a 2-core machine whose /proc/stat is this process's to read

    def tick(others: int, mine: int) -> int:  # one second: 200 jiffies of 2 cores
        clock[0] += 1.0
        machine[0] = (machine[0][0] + others + mine, machine[0][1] + 200)
        own[0] += mine
        return share.now()

    assert tick(0, 200) == 2  # only we are busy: both cores
    assert tick(100, 100) == 1  # another process keeps a core busy: one thread
    assert tick(190, 10) == 1  # never fewer than one
    assert tick(20, 180) == 2  # it is gone: both again
    clock[0] += 0.1
    assert share.now() == 2  # looked at most every INTERVAL
