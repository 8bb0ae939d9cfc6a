"""Helpers of the plugin tests (test_plugins.py, test_plugin_examples.py): installing a plugin package
with pip, offline, into a temporary folder that a spawned `kinfer-rpc` gets on its PYTHONPATH.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from readme_helpers import ROOT


def _setuptools_builds_wheels() -> bool:
    """setuptools builds wheels by itself from 70.1; before that it needs the `wheel` package."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    version = importlib.metadata.version("setuptools").split(".")
    try:
        return (int(version[0]), int(version[1])) >= (70, 1)
    except (ValueError, IndexError):
        return False


def _build_wheel(src: Path, out: Path) -> Path:
    """Build a pure-Python wheel from the package's own pyproject.toml, without setuptools.

    Only for interpreters whose setuptools cannot build wheels offline (a fresh `python -m venv`
    of Python 3.11 has setuptools 65 and no `wheel`; 3.12 has no setuptools at all). The wheel
    carries the same name, version, modules and entry points that setuptools would write.
    """
    project = tomllib.loads((src / "pyproject.toml").read_text())
    meta = project["project"]
    dist = meta["name"].replace("-", "_")
    info = f"{dist}-{meta['version']}.dist-info"
    files = {f"{m}.py": (src / f"{m}.py").read_bytes() for m in project["tool"]["setuptools"]["py-modules"]}
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
        f"Summary: {meta.get('description', '')}\n"
    ).encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: kinfer-rpc tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    groups = meta.get("entry-points", {})
    files[f"{info}/entry_points.txt"] = "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n"
        for group, eps in groups.items()
    ).encode()
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = out / f"{dist}-{meta['version']}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def pip_install(src: Path, work: Path) -> Path:
    """Install the package at `src` with pip, offline, into a fresh folder; return the folder.

    The source is copied first: a build without isolation writes build/ and *.egg-info next to
    the sources, and the tests must not leave files in the repository.
    """
    target = work / "site"
    copy = shutil.copytree(src, work / "src")
    what = str(copy) if _setuptools_builds_wheels() else str(_build_wheel(copy, work))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "--target",
        str(target),
        what,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return target


def entry_points_path(folder: Path) -> str:
    """A folder for PYTHONPATH where kinfer-rpc's metadata declares pyproject.toml's llm entry
    points: none (the installed metadata does) or a copy made from pyproject.toml, for a
    checkout installed (editable) before they were declared."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["llm"]
    installed = {ep.name: ep.value for ep in metadata.distribution("kinfer-rpc").entry_points if ep.group == "llm"}
    if installed == declared:
        return ""
    dist = folder / "kinfer_rpc-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kinfer-rpc\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[llm]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    return str(folder)
