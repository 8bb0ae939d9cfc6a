"""The README's set-up, followed as a person on a fresh machine would: its first command (make a
virtualenv, activate it, `pip install .`, chat with the embedded model) in a fresh copy of the
checkout, then the README's first five minutes in the same shell, `kinfer` found on PATH.

pip reuses its cache and any folder of wheels `PIP_FIND_LINKS` names (CI's own install has just
filled the cache), so this takes about a minute. It is told not to compile llama-cpp-python
(`PIP_ONLY_BINARY`): where no wheel of it is found, the README's command would spend 15-20
minutes compiling, and the test skips, saying so, as it does when pip cannot reach an index.
`kinfer pull` asks a registry on 127.0.0.1 serving a stand-in (see
tests/test_readme_examples.py). The README's second command, the tests' set-up, is what CI
(.ci/run) runs before this test, so it is not run again here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from readme_helpers import README, ROOT, blocks

NO_WHEEL = ("No matching distribution", "Could not find a version", "NewConnectionError", "Network is unreachable")


def fresh_copy(dest: Path) -> Path:
    """The files a clone has: git's tracked files, else the tree without builds and caches."""
    try:
        files = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        ignore = shutil.ignore_patterns(".venv", ".llama", ".git", "node_modules", "__pycache__", "*.egg-info")
        shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
        return dest
    for name in filter(None, (f.decode() for f in files)):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name, follow_symlinks=False)
    return dest


def setup_commands() -> list[str]:
    text = README.read_text()
    start = text.index("\n## Set up\n")
    section = text[start : text.index("\n## ", start + 1)]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


@pytest.mark.setup
@pytest.mark.model
def test_a_fresh_machine_follows_the_readme(tmp_path, registry):  # noqa: F811
    clone = fresh_copy(tmp_path / "kinfer-rpc")
    first, _tests = setup_commands()
    (five_minutes,) = blocks("sh", "The first five minutes")
    # (bash -e does not stop inside an && list: the set-up's own failure ends the script)
    script = f'{first} || exit $?\necho "kinfer is $(command -v kinfer)"\n{five_minutes}'
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LLAMA_CPP_LIB_PATH")}
    e = {k: v for k, v in e.items() if not k.startswith("KINFER_")}  # a machine that never ran kinfer
    e.update(
        HOME=os.environ.get("HOME", str(tmp_path)),  # pip's cache is the user's
        KINFER_HOME=str(tmp_path / "home"),
        KINFER_MODELS=str(tmp_path / "models"),
        OLLAMA_MODELS=str(tmp_path / "ollama"),
        KINFER_REGISTRY=registry.url,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_ONLY_BINARY="llama-cpp-python",  # a wheel, or a skip: never 15 minutes of compiling
        OMP_WAIT_POLICY="PASSIVE",
    )
    started = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-eo", "pipefail", "-c", script],
        cwd=clone,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # pip and what it starts, all ended if it runs too long
    )
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the README's set-up ran past 420 s:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    took = time.monotonic() - started
    if proc.returncode != 0 and "kinfer is" not in stdout and any(word in stderr for word in NO_WHEEL):
        pytest.skip(f"pip found no wheel of llama-cpp-python (PIP_FIND_LINKS) or no index: {stderr[-400:]}")
    assert proc.returncode == 0, f"after {took:.0f} s\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    assert f"kinfer is {clone}/.venv/bin/kinfer" in stdout  # the activated virtualenv's
    assert "pulled qwen3:0.6b" in stdout and "eval rate:" in stderr
    assert took < 300, f"the fresh install and the first five minutes took {took:.0f} s"
