"""A stand-in for Ollama's registry on 127.0.0.1, for `kinfer pull` and the README's examples."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from store_helpers import MEDIA, sha_digest


class Server:
    """Routes (URL path -> bytes or a file), redirects, connections cut once after N bytes, and a
    log of every request (path and headers)."""

    def __init__(self) -> None:
        self.routes: dict[str, bytes | Path] = {}
        self.redirects: dict[str, str] = {}
        self.cut: dict[str, int] = {}  # path -> bytes sent before the connection drops (first time only)
        self.log: list[tuple[str, dict[str, str]]] = []
        self.ranges = True  # False: Range headers ignored, the whole body sent (200)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                server.log.append((path, dict(self.headers)))
                if path in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = server.routes.get(path)
                if body is None:
                    self.send_error(404)
                    return
                size = len(body) if isinstance(body, bytes) else body.stat().st_size
                start = 0
                rng = self.headers.get("Range") if server.ranges else None
                if rng:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(size - start))
                self.end_headers()
                limit = server.cut.pop(path, None)
                left = size - start if limit is None else min(limit, size - start)
                if isinstance(body, bytes):
                    self.wfile.write(body[start : start + left])
                else:
                    with open(body, "rb") as fh:
                        fh.seek(start)
                        while left > 0 and (chunk := fh.read(min(1 << 20, left))):
                            self.wfile.write(chunk)
                            left -= len(chunk)
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def requests(self, path: str) -> list[dict[str, str]]:
        return [h for p, h in self.log if p == path]

    # -- Ollama's registry --------------------------------------------------------------------
    def model(self, repo: str, tag: str, layers: list[tuple[str, bytes | Path, str | None]]) -> dict[str, Any]:
        """A manifest at /v2/<repo>/manifests/<tag>; layers are (kind, content, digest or None:
        the content's own). A blob's digest is served at /v2/<repo>/blobs/<digest>."""
        config = json.dumps({"model_format": "gguf", "model_family": "llama"}).encode()
        entries = []
        for kind, content, digest in [("config", config, None), *layers]:
            if digest is None:
                digest = sha_digest(content if isinstance(content, bytes) else content.read_bytes())
            size = len(content) if isinstance(content, bytes) else content.stat().st_size
            media = "application/vnd.docker.container.image.v1+json" if kind == "config" else MEDIA + kind
            entries.append({"mediaType": media, "digest": digest, "size": size})
            self.routes[f"/v2/{repo}/blobs/{digest}"] = content
        doc = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": entries[0],
            "layers": entries[1:],
        }
        self.routes[f"/v2/{repo}/manifests/{tag}"] = json.dumps(doc).encode()
        return doc
