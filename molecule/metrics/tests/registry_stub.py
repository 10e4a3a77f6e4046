"""A read-only Docker registry (HTTP API v2, one image) on 127.0.0.1, for the offline-rerun test.

Docker Hub cannot be reached from the test machines, so the monitoring images cannot be pulled
here; this serves one tiny image (one layer holding one file) under a name and tag, by its manifest
digest, exactly as a registry does for a pull (GET /v2/, manifests by tag or digest, blobs by
digest), and counts every request, so a test can assert a rerun asked it nothing. Docker treats
127.0.0.0/8 registries as insecure by default: plain HTTP works without daemon configuration.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import platform
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_image(marker: str) -> tuple[bytes, dict[str, bytes]]:
    """(manifest, {digest: blob}) of a one-layer image for this machine's architecture."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        body = f"sparkllm offline-pull test image {marker}\n".encode()
        info = tarfile.TarInfo("sparkllm-test")
        info.size, info.mtime = len(body), 1700000000
        tar.addfile(info, io.BytesIO(body))
    layer = gzip.compress(raw.getvalue(), mtime=0)
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    config = json.dumps({"architecture": arch, "os": "linux", "config": {"Cmd": ["/sparkllm-test"]},
                         "rootfs": {"type": "layers", "diff_ids": [_digest(raw.getvalue())]},
                         "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "registry_stub"}]},
                        sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config),
                   "digest": _digest(config)},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": len(layer),
                    "digest": _digest(layer)}]}, indent=2).encode()
    return manifest, {_digest(config): config, _digest(layer): layer}


class RegistryStub:
    """with RegistryStub("sparkllm-test/prom", "v1") as reg: reg.ref  -> 127.0.0.1:PORT/...:v1@sha256:..."""

    def __init__(self, name: str, tag: str, marker: str = "1") -> None:
        self.name, self.tag = name, tag
        self.manifest, self.blobs = build_image(marker)
        self.digest = _digest(self.manifest)
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
                return

            def _send(self, code: int, body: bytes, ctype: str, digest: str | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                if digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                stub.requests.append(f"{self.command} {self.path}")
                path = self.path.split("?")[0]
                prefix = f"/v2/{stub.name}/"
                if path in ("/v2", "/v2/"):
                    self._send(200, b"{}", "application/json")
                elif path in (prefix + "manifests/" + stub.tag, prefix + "manifests/" + stub.digest):
                    self._send(200, stub.manifest, MANIFEST_TYPE, stub.digest)
                elif path.startswith(prefix + "blobs/") and path[len(prefix) + 6:] in stub.blobs:
                    d = path[len(prefix) + 6:]
                    self._send(200, stub.blobs[d], "application/octet-stream", d)
                else:
                    self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"unknown"}]}',
                               "application/json")

            do_HEAD = do_GET  # noqa: N815 - stdlib name

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.ref = f"127.0.0.1:{self.port}/{name}:{tag}@{self.digest}"
        self.repo = f"127.0.0.1:{self.port}/{name}"
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RegistryStub:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port: from now on a pull cannot reach any registry at this address."""
        if self._thread:
            self.server.shutdown()
            self.server.server_close()
            self._thread = None

    def __exit__(self, *exc: object) -> None:
        self.stop()
