"""Read single files out of a wheel on PyPI without downloading the whole wheel.

A vLLM wheel is 230-430 MB, almost all compiled kernels; its METADATA and the Python sources
are a few KB each. A wheel is a zip file, and PyPI's file host answers HTTP Range requests, so
`zipfile` over a seekable reader that fetches byte ranges reads the central directory and the
wanted members only (a few hundred KB per wheel). Results are cached under .cache/wheel-peek/.

Used by tests/unit/test_vllm_toolchains.py (the per-variant pins against each release's own
METADATA) and, from the command line, to gather the evidence in roles/vllm_build/README.md:

    python tests/unit/wheel_peek.py vllm 0.20.1 --list dflash
    python tests/unit/wheel_peek.py vllm 0.20.1 vllm/model_executor/models/qwen3_dflash.py
"""

from __future__ import annotations

import io
import json
import re
import sys
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "wheel-peek"
SIMPLE = "https://pypi.org/simple/{name}/"
TIMEOUT = 60


class Offline(RuntimeError):
    """PyPI could not be reached (the caller skips, naming this)."""


def _open(url: str, headers: dict | None = None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        return urllib.request.urlopen(req, timeout=TIMEOUT)  # noqa: S310 - fixed https hosts
    except OSError as exc:  # URLError, timeouts, refused connections
        raise Offline(f"cannot reach {url.split('/')[2]}: {exc}") from exc


class RangeReader(io.RawIOBase):
    """A read-only, seekable file over HTTP Range requests (reads ahead in 256 KiB blocks)."""

    BLOCK = 256 * 1024

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0
        self._cache: dict[int, bytes] = {}

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self._cache:
            start = index * self.BLOCK
            end = min(self.size, start + self.BLOCK) - 1
            with _open(self.url, {"Range": f"bytes={start}-{end}"}) as resp:
                if resp.status != 206:
                    raise Offline(f"{self.url}: no Range support (HTTP {resp.status})")
                self._cache[index] = resp.read()
        return self._cache[index]

    def readinto(self, buf):
        want = min(len(buf), self.size - self.pos)
        got = 0
        while got < want:
            index, off = divmod(self.pos, self.BLOCK)
            chunk = self._block(index)[off:off + want - got]
            buf[got:got + len(chunk)] = chunk
            got += len(chunk)
            self.pos += len(chunk)
        return got


def wheel_url(name: str, version: str, platform: str = "aarch64") -> tuple[str, str, int]:
    """(filename, url, size) of the release's wheel for `platform` (first build tag wins)."""
    with _open(SIMPLE.format(name=name), {"Accept": "application/vnd.pypi.simple.v1+json"}) as resp:
        files = json.load(resp)["files"]
    pattern = re.compile(rf"^{re.escape(name)}-{re.escape(version)}-(?:\d+-)?cp\d+-\w+-\w*{platform}\.whl$")
    hits = sorted((f for f in files if pattern.match(f["filename"])), key=lambda f: f["filename"])
    if not hits:
        raise LookupError(f"PyPI has no {platform} wheel of {name} {version}")
    f = hits[-1] if len(hits) == 1 else min(hits, key=lambda f: len(f["filename"]))
    return f["filename"], f["url"], int(f["size"])


def releases(name: str) -> list[str]:
    """Every version of `name` on PyPI that has files, oldest first (PEP 440 order)."""
    from packaging.version import Version  # ships with pip/pytest environments

    with _open(f"https://pypi.org/pypi/{name}/json") as resp:
        data = json.load(resp)
    return sorted((v for v, files in data["releases"].items() if files), key=Version)


def _cache_path(name: str, version: str, member: str) -> Path:
    return CACHE / f"{name}-{version}" / member


def read_members(name: str, version: str, members: list[str]) -> dict[str, str]:
    """Text of each member (cached); a member the wheel lacks maps to ''."""
    out, missing = {}, []
    for m in members:
        p = _cache_path(name, version, m)
        if p.is_file():
            out[m] = p.read_text()
        else:
            missing.append(m)
    if missing:
        _, url, size = wheel_url(name, version)
        with zipfile.ZipFile(RangeReader(url, size)) as zf:
            names = set(zf.namelist())
            for m in missing:
                text = zf.read(m).decode() if m in names else ""
                p = _cache_path(name, version, m)
                p.parent.mkdir(parents=True, exist_ok=True)
                tmp = p.with_suffix(p.suffix + ".tmp")
                tmp.write_text(text)
                tmp.replace(p)
                out[m] = text
    return out


def list_members(name: str, version: str) -> list[str]:
    p = _cache_path(name, version, "_namelist.json")
    if p.is_file():
        return json.loads(p.read_text())
    _, url, size = wheel_url(name, version)
    with zipfile.ZipFile(RangeReader(url, size)) as zf:
        names = zf.namelist()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.with_suffix(".tmp").write_text(json.dumps(names))
    p.with_suffix(".tmp").replace(p)
    return names


def metadata(name: str, version: str) -> str:
    """The wheel's .dist-info/METADATA text."""
    member = f"{name}-{version}.dist-info/METADATA"
    text = read_members(name, version, [member])[member]
    if not text:
        raise LookupError(f"{member} is not in the {name} {version} wheel")
    return text


def requires_dist(name: str, version: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata(name, version).splitlines()
            if line.startswith("Requires-Dist:")]


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    name, version, *rest = argv[1:]
    try:
        if rest[:1] == ["--list"]:
            pat = re.compile(rest[1] if len(rest) > 1 else ".")
            print("\n".join(n for n in list_members(name, version) if pat.search(n)))
        elif rest:
            for m, text in read_members(name, version, rest).items():
                print(f"==== {m}\n{text}")
        else:
            print("\n".join(requires_dist(name, version)))
    except (Offline, LookupError) as exc:
        print(f"wheel_peek: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
