"""The source distributions of the vLLM releases we build, fetched once and pinned by sha256.

Each variant's sdist (vllm-<version>.tar.gz on PyPI; url and sha256 from PyPI's simple index JSON API,
recorded in scripts/sparkllm/lock/vllm_sdists.json) is downloaded into the machine cache
(~/.cache/sparkllm/vllm-sdist/) and only the files the build contract reads are extracted into
.cache/vllm-src/<version>/ (CMakeLists.txt, cmake/,
requirements/, setup.py, use_existing_torch.py, pyproject.toml, tools/build_rust.py and the Marlin
sources whose arch guards we cite). A second call finds both and does nothing. Standard library only:
tests/contract/setup_vllm_env.sh runs it as `python -m sparkllm.lock.sources` (scripts/ on PYTHONPATH;
exit 0 done, 1 a download or hash failed, 2 usage).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..fileio import sha256_file  # the project's one sha256 of a file

ROOT = Path(__file__).resolve().parents[3]  # the checkout (scripts/sparkllm/lock/sources.py)
PINS = Path(__file__).resolve().parent / "vllm_sdists.json"
CACHE = ROOT / ".cache"
# Downloads pinned by sha256 (sdists, wheels) and results keyed by the sha256 of their inputs (pip's
# resolution) outlive a checkout: they are kept per machine, so a fresh clone (CI) does not fetch them again.
# SPARKLLM_MACHINE_CACHE moves it; tests/contract/setup_vllm_env.sh keeps the contract venv there too.
MACHINE_CACHE = Path(os.environ.get("SPARKLLM_MACHINE_CACHE")
                     or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparkllm")
# prefixes (inside vllm-<version>/) the contract reads
MEMBERS = ("CMakeLists.txt", "cmake/", "requirements/", "setup.py", "use_existing_torch.py",
           "pyproject.toml", "tools/build_rust.py", "csrc/quantization/marlin/",
           "csrc/quantization/gptq_marlin/", "csrc/moe/marlin_moe_wna16/")


def pins() -> dict[str, dict[str, str]]:
    return json.loads(PINS.read_text())



def fetch_pinned(url: str, sha256: str, dest_dir: Path, pins_name: str) -> Path:
    """``url`` in ``dest_dir`` under its own file name, checked against ``sha256`` (downloaded when missing
    or wrong, through a temporary file moved into place only once its hash matches)."""
    dest = dest_dir / url.rsplit("/", 1)[1]
    if dest.exists() and sha256_file(dest) == sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=120) as resp:  # noqa: S310
            shutil.copyfileobj(resp, out, 1 << 20)
        got = sha256_file(Path(tmp))
        if got != sha256:
            raise RuntimeError(f"{url} has sha256 {got}, {pins_name} pins {sha256}: "
                               "PyPI served other bytes; check the pin against the simple index")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def sdist(version: str) -> Path:
    """The pinned sdist of ``version`` in the machine cache (downloaded when missing or wrong)."""
    pin = pins()[version]
    return fetch_pinned(pin["url"], pin["sha256"], MACHINE_CACHE / "vllm-sdist", PINS.name)


def extracted_once(out: Path, sha256: str, fill: Callable[[Path], None]) -> Path:
    """``out``, filled by ``fill(tmp)`` in a temporary sibling and moved into place with a ``.complete``
    stamp holding ``sha256`` (the archive's); a tree whose stamp matches is returned as it is."""
    stamp = out / ".complete"
    if stamp.exists() and stamp.read_text() == sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        fill(tmp)
        (tmp / ".complete").write_text(sha256)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def source_tree(version: str) -> Path:
    """.cache/vllm-src/<version>: the extracted members of the pinned sdist (extracted once)."""
    top = f"vllm-{version}/"

    def fill(tmp: Path) -> None:
        with tarfile.open(sdist(version)) as tar:
            for m in tar.getmembers():
                rel = m.name[len(top):] if m.name.startswith(top) else None
                if not rel or not rel.startswith(MEMBERS) or not (m.isfile() or m.isdir()):
                    continue
                m.name = rel
                tar.extract(m, tmp, filter="data")

    return extracted_once(CACHE / "vllm-src" / version, pins()[version]["sha256"], fill)


def main(argv: list[str]) -> int:
    versions = argv or sorted(pins())
    unknown = [v for v in versions if v not in pins()]
    if unknown:
        print(f"vllm_sources: no pin for {', '.join(unknown)} in {PINS}; add its url and sha256",
              file=sys.stderr)
        return 2
    for v in versions:
        try:
            print(f"vllm_sources: {v}: {source_tree(v)}")
        except (OSError, RuntimeError, tarfile.TarError) as exc:
            print(f"vllm_sources: {v}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
