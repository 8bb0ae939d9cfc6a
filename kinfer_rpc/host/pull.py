"""`kinfer pull` and `kinfer rm`: models from Ollama's registry and Hugging Face, into kinfer's folder.

The folder (`$KINFER_MODELS` or `~/.kinfer/models`) takes Ollama's on-disk layout: a manifest
`manifests/<host>/<namespace>/<model>/<tag>` whose layers name blobs `blobs/sha256-<hex>`, so the
store lists what was pulled as it lists Ollama's own models.

- A name `[host/][namespace/]model[:tag]` (defaults registry.ollama.ai, library, latest) is fetched
  from the registry's HTTP API: `GET /v2/<namespace>/<model>/manifests/<tag>`, then each layer from
  `/v2/<namespace>/<model>/blobs/<digest>` (redirects followed). Ollama's registry is
  `$KINFER_REGISTRY` (default https://registry.ollama.ai); another host is asked over https, or
  http with `insecure`.
- `hf.co/ORG/REPO[:QUANT]` lists the repository's files (`$KINFER_HF_ENDPOINT`, default
  https://huggingface.co: `/api/models/ORG/REPO/tree/main`), picks one GGUF (the file whose name
  holds QUANT, case-insensitively; without a tag Q4_K_M, else the only one) and writes a manifest
  with it as the one model layer, under host hf.co and tag QUANT (or latest).

Every blob is downloaded into `blobs/sha256-<hex>.partial`, continued with an HTTP Range request
after a cut connection (here, or in a later pull), and installed only when its size and sha256 are
the manifest's; the manifest is written last, so a model is listed only once it is whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from kinfer_rpc.host.files import read_regular, write_whole
from kinfer_rpc.host.store import OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG, kinfer_dir, ollama_dir

DEFAULT_REGISTRY = "https://registry.ollama.ai"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
HF_HOSTS = ("hf.co", "huggingface.co")
HF_DEFAULT_QUANT = "Q4_K_M"
MANIFEST_MEDIA = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA = "application/vnd.docker.container.image.v1+json"
MODEL_MEDIA = "application/vnd.ollama.image.model"
_MANIFEST_LIMIT = 4 << 20  # a manifest is a few kB; a tree listing a few hundred
_LISTING_LIMIT = 16 << 20
_CHUNK = 1 << 20
_TIMEOUT = 60.0  # seconds without a byte before a connection counts as cut
_RETRIES = 5  # cut connections continued within one pull
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a namespace, model or tag: never "." or ".."
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]{1,5})?")

# progress(description, bytes done, bytes in all or None)
ProgressFn = Callable[[str, int, int | None], None]


class PullError(Exception):
    """A pull or removal that failed; the message says why, for a person."""


@attrs.frozen
class Name:
    host: str
    namespace: str
    model: str
    tag: str
    explicit_tag: bool = True

    @property
    def display(self) -> str:
        """As `kinfer list` shows it (as `ollama list` does)."""
        if self.host != OLLAMA_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace == OLLAMA_NAMESPACE:
            return f"{self.model}:{self.tag}"
        return f"{self.namespace}/{self.model}:{self.tag}"

    @property
    def is_hf(self) -> bool:
        return self.host.casefold() in HF_HOSTS

    def manifest(self, root: Path) -> Path:
        return root / "manifests" / self.host / self.namespace / self.model / self.tag


def parse_name(name: str) -> Name:
    """`[host/][namespace/]model[:tag]`; `hf.co/ORG/REPO[:QUANT]` is Hugging Face (host hf.co)."""
    parts = name.strip().split("/")
    bad = PullError(
        f"{name!r} is not a model name: [host/][namespace/]model[:tag] "
        "(qwen3:0.6b, alice/tool:v1, hf.co/ORG/REPO:Q4_K_M)"
    )
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise bad
    model, colon, tag = parts[-1].partition(":")
    if len(parts) == 1:
        host, namespace = OLLAMA_HOST, OLLAMA_NAMESPACE
    elif len(parts) == 2:
        host, namespace = OLLAMA_HOST, parts[0]
    else:
        host, namespace = parts[0], parts[1]
    if host.casefold() in HF_HOSTS:
        host = "hf.co"
    if not _HOST.fullmatch(host) or not _PART.fullmatch(namespace) or not _PART.fullmatch(model):
        raise bad
    if colon and not _PART.fullmatch(tag):
        raise bad
    return Name(host, namespace, model, tag or OLLAMA_TAG, explicit_tag=bool(colon))


# -- HTTP ----------------------------------------------------------------------------------------
def _request(url: str, headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(url, headers={"User-Agent": "kinfer-pull", **(headers or {})})
    return urllib.request.urlopen(req, timeout=_TIMEOUT)  # follows redirects, keeping Range


def _read_limited(resp: IO[bytes], limit: int, what: str) -> bytes:
    data = resp.read(limit + 1)
    if len(data) > limit:
        raise PullError(f"{what} is larger than {limit} bytes")
    return data


def _get_json(url: str, what: str, not_found: str, headers: dict[str, str] | None = None) -> Any:
    try:
        with _request(url, headers) as resp:
            data = _read_limited(resp, _LISTING_LIMIT, what)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise PullError(not_found) from None
        raise PullError(f"{what}: {url} answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PullError(f"{what}: cannot reach {url}: {reason}") from None
    try:
        return json.loads(data)
    except ValueError:
        raise PullError(f"{what}: {url} did not answer JSON") from None


# -- blobs ---------------------------------------------------------------------------------------
def blob_path(root: Path, digest: str) -> Path:
    if not _DIGEST.fullmatch(digest):
        raise PullError(f"{digest!r} is not a sha256 digest (sha256:<64 hex digits>)")
    return root / "blobs" / digest.replace(":", "-")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[IO[bytes]]:
    """The partial file, opened for appending (never through a link, never a FIFO or device),
    held by this process alone."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        raise PullError(f"cannot write {path} (a symbolic link is not followed): {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PullError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    fh = os.fdopen(fd, "a+b")
    try:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no fcntl (Windows): no lock
            pass
        except OSError:
            raise PullError(f"another pull is downloading {path.name} right now") from None
        yield fh
    finally:
        fh.close()


def fetch_blob(
    url: str,
    root: Path,
    digest: str,
    size: int,
    *,
    label: str = "",
    progress: ProgressFn | None = None,
    retries: int = _RETRIES,
) -> Path:
    """Download `url` into blobs/ as `digest`: resumed from a partial file with Range requests
    (after a cut connection, here or in an earlier pull), verified by size and sha256. A digest
    that does not match deletes the partial file and fails."""
    final = blob_path(root, digest)
    label = label or digest[7:19]
    if final.is_file() and final.stat().st_size == size:
        if progress:
            progress(label, size, size)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    with _locked(partial) as fh:
        done = fh.tell()
        if done > size:  # not this blob's beginning
            fh.truncate(0)
            done = 0
        sha = hashlib.sha256()
        if done:
            at = 0
            while at < done and (chunk := os.pread(fh.fileno(), min(_CHUNK, done - at), at)):
                sha.update(chunk)
                at += len(chunk)
        if progress:
            progress(label, done, size)
        attempt = 0
        while done < size:
            headers = {"Range": f"bytes={done}-"} if done else {}
            try:
                with _request(url, headers) as resp:
                    if done and resp.status != 206:  # the server sent the whole blob again
                        fh.truncate(0)
                        done, sha = 0, hashlib.sha256()
                    elif done and not _continues(resp.headers.get("Content-Range", ""), done):
                        raise PullError(f"{url} answered a range that does not start at byte {done}")
                    while chunk := resp.read(min(_CHUNK, size + 1 - done)):
                        fh.write(chunk)
                        sha.update(chunk)
                        done += len(chunk)
                        if done > size:
                            break
                        if progress:
                            progress(label, done, size)
                    fh.flush()
                if done < size:
                    raise ConnectionError(f"the connection closed after {done} of {size} bytes")
            except urllib.error.HTTPError as exc:
                if exc.code == 416 and done:  # nothing after `done`: start afresh
                    fh.truncate(0)
                    done, sha = 0, hashlib.sha256()
                    attempt += 1
                    if attempt <= retries:
                        continue
                if exc.code == 404:
                    raise PullError(f"{label}: the blob {digest} is not in the registry ({url}: HTTP 404)") from None
                raise PullError(f"{label}: {url} answered HTTP {exc.code} {exc.reason}") from None
            except (urllib.error.URLError, OSError, ConnectionError, EOFError) as exc:
                fh.flush()
                attempt += 1
                if attempt > retries:
                    reason = getattr(exc, "reason", exc)
                    raise PullError(
                        f"{label}: the download stopped at {done} of {size} bytes ({reason}); pull again to continue it"
                    ) from None
                time.sleep(min(0.2 * 2**attempt, 5.0))
                continue
            except http.client.HTTPException as exc:  # IncompleteRead and its kin: a cut connection too
                fh.flush()
                attempt += 1
                if attempt > retries:
                    raise PullError(
                        f"{label}: the download stopped at {done} of {size} bytes ({exc!r}); pull again to continue it"
                    ) from None
                time.sleep(min(0.2 * 2**attempt, 5.0))
                continue
        actual = "sha256:" + sha.hexdigest()
        if done != size or actual != digest:
            fh.close()
            partial.unlink(missing_ok=True)
            got = f"{done} bytes" if done != size else f"sha256 {actual}"
            raise PullError(
                f"{label}: the download does not match its digest: got {got}, expected {size} bytes "
                f"with {digest}; the partial file was deleted"
            )
    os.replace(partial, final)
    return final


def _continues(content_range: str, start: int) -> bool:
    m = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", content_range)
    return m is not None and int(m.group(1)) == start


# -- the two sources ------------------------------------------------------------------------------
@attrs.frozen
class Pulled:
    name: str  # as `kinfer list` shows it
    manifest: Path
    size_bytes: int
    file: str | None = None  # the GGUF file picked from a Hugging Face repository


def _layers(doc: Any, where: str) -> list[dict[str, Any]]:
    """The config and layers of a registry manifest, each checked: a sha256 digest (so blobs stay
    inside blobs/) and a size."""
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list):
        raise PullError(f"{where}: the manifest has no list of layers")
    out = []
    for layer in [doc["config"]] if isinstance(doc.get("config"), dict) else []:
        out.append(layer)
    out.extend(doc["layers"])
    for layer in out:
        if not isinstance(layer, dict) or not isinstance(layer.get("digest"), str):
            raise PullError(f"{where}: a layer of the manifest has no digest")
        if not _DIGEST.fullmatch(layer["digest"]):
            raise PullError(f"{where}: the layer digest {layer['digest']!r} is not sha256:<64 hex digits>")
        size = layer.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PullError(f"{where}: the layer {layer['digest']} has no size")
    return out


def _write_manifest(path: Path, data: bytes) -> None:
    write_whole(path, data)


def _registry_base(name: Name, registry: str | None, insecure: bool) -> str:
    if name.host == OLLAMA_HOST:
        return (registry or os.environ.get("KINFER_REGISTRY") or DEFAULT_REGISTRY).rstrip("/")
    return f"{'http' if insecure else 'https'}://{name.host}"


def pull_registry(
    name: Name,
    root: Path,
    *,
    registry: str | None = None,
    insecure: bool = False,
    progress: ProgressFn | None = None,
    retries: int = _RETRIES,
) -> Pulled:
    base = _registry_base(name, registry, insecure)
    repo = f"{urllib.parse.quote(name.namespace)}/{urllib.parse.quote(name.model)}"
    url = f"{base}/v2/{repo}/manifests/{urllib.parse.quote(name.tag)}"
    try:
        with _request(url, {"Accept": MANIFEST_MEDIA}) as resp:
            raw = _read_limited(resp, _MANIFEST_LIMIT, f"the manifest of {name.display}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise PullError(f"{name.display}: model not found in the registry ({base})") from None
        raise PullError(f"{name.display}: {url} answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PullError(f"{name.display}: cannot reach the registry {base}: {getattr(exc, 'reason', exc)}") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        raise PullError(f"{name.display}: the registry's manifest is not JSON") from None
    layers = _layers(doc, name.display)
    for layer in layers:
        media = str(layer.get("mediaType", ""))
        kind = "config" if layer is doc.get("config") else media.removeprefix("application/vnd.ollama.image.")
        fetch_blob(
            f"{base}/v2/{repo}/blobs/{layer['digest']}",
            root,
            layer["digest"],
            layer["size"],
            label=f"{kind} {layer['digest'][7:19]}",
            progress=progress,
            retries=retries,
        )
    manifest = _find(root, name) or name.manifest(root)  # a name pulled before, in another case
    _write_manifest(manifest, raw)
    return Pulled(name.display, manifest, sum(int(x["size"]) for x in layers))


def pick_gguf(files: list[str], quant: str | None) -> str:
    """The GGUF file of a repository as Ollama picks it: the one whose name holds the quant
    (case-insensitively; a match standing alone in the name wins over a longer one: Q4_K picks
    model-Q4_K.gguf over model-Q4_K_M.gguf); without a quant Q4_K_M, else the only GGUF."""
    ggufs = [f for f in files if f.casefold().endswith(".gguf") and "mmproj" not in f.casefold()]
    if not ggufs:
        raise PullError("the repository has no .gguf file")

    def matching(q: str) -> list[str]:
        hits = [f for f in ggufs if q.casefold() in f.rsplit("/", 1)[-1].casefold()]
        alone = re.compile(rf"(?<![A-Za-z0-9]){re.escape(q)}(?![A-Za-z0-9_])", re.IGNORECASE)
        whole = [f for f in hits if alone.search(f.rsplit("/", 1)[-1])]
        return whole or hits

    hits = matching(quant or HF_DEFAULT_QUANT)
    if not hits and quant is None and len(ggufs) == 1:
        hits = ggufs
    if len(hits) == 1:
        return hits[0]
    choices = ", ".join(sorted(ggufs))
    if not hits:
        raise PullError(f"no .gguf file matches {quant or HF_DEFAULT_QUANT!r}; the repository has: {choices}")
    split = [f for f in hits if re.search(r"-\d{5}-of-\d{5}\.gguf$", f, re.IGNORECASE)]
    if split and len(split) == len(hits):
        raise PullError(f"{quant or HF_DEFAULT_QUANT} is split over several files ({', '.join(hits)}): not supported")
    raise PullError(f"{quant or HF_DEFAULT_QUANT!r} matches several files: {', '.join(hits)}; name one with :QUANT")


def pull_hf(
    name: Name,
    root: Path,
    *,
    endpoint: str | None = None,
    progress: ProgressFn | None = None,
    retries: int = _RETRIES,
) -> Pulled:
    base = (endpoint or os.environ.get("KINFER_HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")
    repo = f"{urllib.parse.quote(name.namespace)}/{urllib.parse.quote(name.model)}"
    listing = _get_json(
        f"{base}/api/models/{repo}/tree/main?recursive=true",
        f"the files of {name.namespace}/{name.model}",
        f"{name.display}: model not found on Hugging Face ({base}/{name.namespace}/{name.model})",
    )
    if not isinstance(listing, list):
        raise PullError(f"{name.display}: Hugging Face's file listing is not a list")
    files = {
        str(e["path"]): e
        for e in listing
        if isinstance(e, dict) and e.get("type", "file") == "file" and isinstance(e.get("path"), str)
    }
    quant = name.tag if name.explicit_tag else None
    try:
        chosen = pick_gguf(list(files), quant)
    except PullError as exc:
        raise PullError(f"{name.display}: {exc}") from None
    lfs = files[chosen].get("lfs")
    oid = lfs.get("oid") if isinstance(lfs, dict) else None
    size = lfs.get("size") if isinstance(lfs, dict) else None
    if not isinstance(oid, str) or not re.fullmatch(r"[0-9a-f]{64}", oid) or not isinstance(size, int):
        raise PullError(f"{name.display}: Hugging Face gives no sha256 for {chosen}, so it cannot be verified")
    digest = f"sha256:{oid}"
    fetch_blob(
        f"{base}/{repo}/resolve/main/{urllib.parse.quote(chosen)}",
        root,
        digest,
        size,
        label=chosen.rsplit("/", 1)[-1],
        progress=progress,
        retries=retries,
    )
    wanted = quant or HF_DEFAULT_QUANT
    config = json.dumps(
        {
            "model_format": "gguf",
            "file_type": wanted.upper() if wanted.casefold() in chosen.casefold() else "",
            "rootfs": {"type": "layers", "diff_ids": [digest]},
            "source": f"{base}/{name.namespace}/{name.model}/blob/main/{chosen}",
        }
    ).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    config_path = blob_path(root, config_digest)
    if not config_path.is_file():
        _write_manifest(config_path, config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA,
        "config": {"mediaType": CONFIG_MEDIA, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": MODEL_MEDIA, "digest": digest, "size": size}],
    }
    path = _find(root, name) or name.manifest(root)
    _write_manifest(path, json.dumps(manifest, indent=2).encode())
    return Pulled(name.display, path, size + len(config), file=chosen)


def pull(
    name: str,
    *,
    registry: str | None = None,
    hf_endpoint: str | None = None,
    insecure: bool = False,
    progress: ProgressFn | None = None,
    root: Path | None = None,
    retries: int = _RETRIES,
) -> Pulled:
    """Pull a model into kinfer's folder (or `root`): from Hugging Face for hf.co/..., else from
    Ollama's registry (or the registry its host names)."""
    parsed = parse_name(name)
    folder = root or kinfer_dir()
    if parsed.is_hf:
        return pull_hf(parsed, folder, endpoint=hf_endpoint, progress=progress, retries=retries)
    return pull_registry(parsed, folder, registry=registry, insecure=insecure, progress=progress, retries=retries)


# -- rm --------------------------------------------------------------------------------------------
def _manifests(root: Path) -> list[Path]:
    folder = root / "manifests"
    if not folder.is_dir():
        return []
    return [m for m in sorted(folder.glob("*/*/*/*")) if m.is_file() and not m.name.startswith(".")]


def _find(root: Path, name: Name) -> Path | None:
    """The manifest of `name` under root, its parts compared case-insensitively (as Ollama does)."""
    want = (name.host, name.namespace, name.model, name.tag)
    for manifest in _manifests(root):
        if tuple(p.casefold() for p in manifest.parts[-4:]) == tuple(p.casefold() for p in want):
            return manifest
    return None


def _digests(manifest: Path) -> set[str]:
    """The blobs a manifest references (a broken manifest references none that can be named)."""
    try:
        doc = json.loads(read_regular(manifest, _MANIFEST_LIMIT))
    except (OSError, ValueError):
        return set()
    layers = list(doc.get("layers") or []) if isinstance(doc, dict) else []
    if isinstance(doc, dict) and isinstance(doc.get("config"), dict):
        layers.append(doc["config"])
    return {x["digest"] for x in layers if isinstance(x, dict) and _DIGEST.fullmatch(str(x.get("digest", "")))}


def remove(name: str, root: Path | None = None) -> tuple[str, list[Path]]:
    """Delete a pulled model's manifest from kinfer's folder, and the blobs no other manifest
    there references. Ollama's own folder is never touched. (display name, blobs deleted)"""
    parsed = parse_name(name)
    folder = root or kinfer_dir()
    manifest = _find(folder, parsed)
    if manifest is None:
        if _find(ollama_dir(), parsed) is not None:
            raise PullError(
                f"{parsed.display} is in Ollama's store ({ollama_dir()}), which kinfer only reads: "
                "remove it with `ollama rm`"
            )
        raise PullError(f"{parsed.display}: no model kinfer pulled has this name (`kinfer list` shows them)")
    gone = _digests(manifest)
    manifest.unlink()
    for parent in list(manifest.parents)[:3]:  # the model's, namespace's and host's folders, when empty
        with contextlib.suppress(OSError):
            parent.rmdir()
    kept: set[str] = set()
    for other in _manifests(folder):
        kept |= _digests(other)
    deleted = []
    for digest in sorted(gone - kept):
        blob = blob_path(folder, digest)
        with contextlib.suppress(FileNotFoundError):
            blob.unlink()
            deleted.append(blob)
    return _ollama_display_of(manifest), deleted


def _ollama_display_of(manifest: Path) -> str:
    host, namespace, model, tag = manifest.parts[-4:]
    return Name(host, namespace, model, tag).display
