"""The FlashInfer wheels our variants install, fetched once and pinned by sha256, and the evidence on
FlashInfer's prebuilt kernels (which of its packages carry SM12x code).

- ``flashinfer-python`` of each variant's toolchain (data/flashinfer_packages.json ``wheels``: url and sha256
  from PyPI's simple index) is downloaded into the machine cache (~/.cache/sparkllm/flashinfer-wheels/,
  7-15 MB each) and the files the AOT contract reads are extracted into .cache/flashinfer-src/<version>/
  together with the wheel's name list.
  tests/contract/setup_vllm_env.sh runs this (a second run only checks the stamps).
- ``--listing --cuobjdump PATH`` (by hand, not in CI) rewrites the ``evidence`` of that file: for each
  flashinfer-cubin release our toolchains pin, the SASS architectures of its cubins (every cubin's name;
  ``cuobjdump --list-elf`` of a sample of each directory, read through HTTP ranges, never the whole
  267 MB wheel); and whether PyPI publishes flashinfer-jit-cache at all.

    python tests/contract/flashinfer_sources.py [--listing --cuobjdump PATH]

Exit status: 0 done, 1 a download, hash or listing failed, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))  # tests.unit.wheel_peek, when run as a script
from sparkllm.fileio import write_json_atomic  # noqa: E402

# one pinned download for the sdists and these wheels
from sparkllm.lock.sources import MACHINE_CACHE, extracted_once, fetch_pinned  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "flashinfer_packages.json"
CACHE = ROOT / ".cache"
# files of the installed package the AOT contract reads
MEMBERS = ("flashinfer/aot.py", "flashinfer/jit/env.py", "flashinfer/jit/core.py",
           "flashinfer/jit/cpp_ext.py",
           "flashinfer/compilation_context.py", "flashinfer/__main__.py")
SAMPLE = 5  # cubins per directory listed with cuobjdump


def pins() -> dict:
    return json.loads(DATA.read_text())


def wheel(version: str) -> Path:
    pin = pins()["wheels"][version]
    return fetch_pinned(pin["url"], pin["sha256"], MACHINE_CACHE / "flashinfer-wheels", DATA.name)


def package_tree(version: str) -> Path:
    """.cache/flashinfer-src/<version>: MEMBERS of the pinned wheel plus names.json (every member's name)."""
    def fill(tmp: Path) -> None:
        with zipfile.ZipFile(wheel(version)) as z:
            names = z.namelist()
            for m in MEMBERS:
                if m in names:
                    z.extract(m, tmp)
        (tmp / "names.json").write_text(json.dumps(names))

    return extracted_once(CACHE / "flashinfer-src" / version, pins()["wheels"][version]["sha256"], fill)


def _simple(name: str) -> dict | None:
    req = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def cubin_listing(cuobjdump: str, version: str) -> dict:
    from tests.unit import wheel_peek  # HTTP-range reader of a wheel on PyPI (tests/unit/wheel_peek.py)

    index = _simple("flashinfer-cubin") or {"files": []}
    files = [f for f in index["files"] if f["filename"] == f"flashinfer_cubin-{version}-py3-none-any.whl"]
    if not files:
        return {"on_pypi": False, "versions_on_pypi": index.get("versions", [])}
    f = files[0]
    by_dir: dict[str, list[str]] = defaultdict(list)
    with zipfile.ZipFile(wheel_peek.RangeReader(f["url"], int(f["size"]))) as z:
        cubins = [n for n in z.namelist() if n.endswith(".cubin")]
        for n in cubins:
            by_dir[n.rsplit("/", 1)[0]].append(n)
        named = Counter(m.lower() for n in cubins for m in re.findall(r"(?i)sm_?(\d{2,3}[af]?)", n))
        listed: Counter = Counter()
        with tempfile.TemporaryDirectory() as tmp:
            for d, members in sorted(by_dir.items()):
                for n in members[:SAMPLE]:
                    p = Path(tmp) / "x.cubin"
                    p.write_bytes(z.read(n))
                    out = subprocess.run([cuobjdump, "--list-elf", str(p)], capture_output=True, text=True,
                                         check=False)
                    for a in set(re.findall(r"sm_\d+[af]?", out.stdout + out.stderr)):
                        listed[f"{d.split('/')[-1]}: {a}"] += 1
    return {"on_pypi": True, "filename": f["filename"], "sha256": f["hashes"]["sha256"],
            "cubins": len(cubins),
            "archs_in_names": dict(sorted(named.items())),
            "cuobjdump_sample": {"per_directory": SAMPLE, "listed": dict(sorted(listed.items()))}}


def listing(cuobjdump: str) -> dict:
    import yaml

    variants = yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_vllm_variants"]
    cubin_versions = sorted({str(c["toolchain"]["flashinfer-python"]) for c in variants.values()})
    jit = _simple("flashinfer-jit-cache")
    return {"flashinfer-cubin": {v: cubin_listing(cuobjdump, v) for v in cubin_versions},
            "flashinfer-jit-cache": {"on_pypi": jit is not None,
                                     "versions_on_pypi": (jit or {}).get("versions", [])}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listing", action="store_true",
                   help="rewrite the evidence in data/flashinfer_packages.json")
    p.add_argument("--cuobjdump", help="cuobjdump of the nvidia-cuda-cuobjdump wheel (with --listing)")
    args = p.parse_args(argv)
    if args.listing and not (args.cuobjdump and os.access(args.cuobjdump, os.X_OK)):
        print("flashinfer_sources: --listing needs --cuobjdump PATH (pip download nvidia-cuda-cuobjdump)",
              file=sys.stderr)
        return 2
    try:
        if args.listing:
            doc = pins()
            doc["evidence"] = listing(args.cuobjdump)
            write_json_atomic(DATA, doc, indent=1)
            print(f"flashinfer_sources: wrote {DATA}")
        for v in sorted(pins()["wheels"]):
            print(f"flashinfer_sources: {v}: {package_tree(v)}")
    except (OSError, RuntimeError, zipfile.BadZipFile) as exc:
        print(f"flashinfer_sources: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
