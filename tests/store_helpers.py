"""Ollama model stores made on disk for the tests: manifests, blobs and their digests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MEDIA = "application/vnd.ollama.image."


def sha_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def place(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class OllamaStore:
    """An Ollama models folder: blobs/sha256-<hex> and manifests/<host>/<ns>/<model>/<tag>."""

    def __init__(self, root: Path):
        self.root = root
        (root / "blobs").mkdir(parents=True, exist_ok=True)

    def blob(self, data: bytes, media: str) -> dict:
        digest = sha_digest(data)
        (self.root / "blobs" / digest.replace(":", "-")).write_bytes(data)
        return {"mediaType": MEDIA + media, "digest": digest, "size": len(data)}

    def manifest(self, name: str, layers: list[dict]) -> Path:
        config = self.blob(json.dumps({"model_format": "gguf", "model_family": "llama"}).encode(), "config")
        config["mediaType"] = "application/vnd.docker.container.image.v1+json"
        doc = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": config,
            "layers": layers,
        }
        path = self.root / "manifests" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
        return path
