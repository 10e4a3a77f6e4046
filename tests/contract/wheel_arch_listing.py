"""List the GPU code (SASS and PTX) in the compiled extensions of vLLM's published aarch64 wheels.

The evidence for "wheel or compile" (roles/vllm_build/README.md): for each variant's wheel, which
architectures each extension library carries, and for Marlin (our INT4 hot path) which of its kernels
exist as SASS for the SM12x family and which only as PTX. Run once by hand, not in CI (it downloads
the wheels, 300-400 MB each); the result is committed as tests/contract/data/wheel_archs.json and
tests/contract/test_build_arch_contract.py compares it with the CMake table of the same release.

    python tests/contract/wheel_arch_listing.py --cuobjdump PATH [--wheel-dir DIR] [--out FILE]

cuobjdump comes from the `nvidia-cuda-cuobjdump` wheel (any host architecture: it reads the fatbins).
Each wheel is downloaded only when it is not in --wheel-dir already, and its sha256 must match the pin
of its variant (spark_vllm_variants.<variant>.wheel in group_vars/all/methods.yml).
readelf (binutils) names the CUDA runtime each library links.
Exit status: 0 written, 1 a download, hash or cuobjdump failed, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from sparkllm.fileio import sha256_file  # noqa: E402  (the project's one sha256 of a file)

DEFAULT_OUT = ROOT / "tests" / "contract" / "data" / "wheel_archs.json"
MARLIN = re.compile(r"marlin", re.IGNORECASE)



def fetch(url: str, sha256: str, dest_dir: Path) -> Path:
    dest = dest_dir / url.rsplit("/", 1)[1]
    if not dest.exists():
        dest_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest_dir, suffix=".part")
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=120) as resp:  # noqa: S310
            while block := resp.read(1 << 20):
                out.write(block)
        os.replace(tmp, dest)
    got = sha256_file(dest)
    if got != sha256:
        raise SystemExit(f"wheel_arch_listing: {dest} has sha256 {got}, the pin says {sha256}; "
                         "delete it or fix the pin")
    return dest


def functions_by_arch(cuobjdump: str, lib: Path, mode: str) -> dict[str, list[str]]:
    """{arch: [kernel names]} of the SASS (mode 'sass') or PTX (mode 'ptx') in one library."""
    flag = "--dump-resource-usage" if mode == "sass" else "--dump-ptx"
    out = subprocess.run([cuobjdump, flag, str(lib)], capture_output=True, text=True, check=False)
    if out.returncode != 0 and "does not contain" not in out.stderr:
        raise SystemExit(f"wheel_arch_listing: cuobjdump {flag} {lib.name} failed: "
                         f"{out.stderr.strip()[:300]}")
    found: dict[str, list[str]] = {}
    arch = None
    for line in out.stdout.splitlines():
        if line.startswith("arch = "):
            arch = line.split("=", 1)[1].strip()
            found.setdefault(arch, [])
        elif arch and mode == "sass" and line.startswith(" Function "):
            found[arch].append(line.split(" Function ", 1)[1].rstrip(":"))
        elif arch and mode == "ptx" and ".entry " in line:
            found[arch].append(line.split(".entry ", 1)[1].split("(", 1)[0].strip())
    return found


def cuda_runtime(lib: Path) -> str:
    """The libcudart soname the library links (the CUDA major it was built with), "" when none."""
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=False).stdout
    found = re.findall(r"\[(libcudart\.so[.0-9]*)\]", out)
    return found[0] if found else ""


def describe(cuobjdump: str, lib: Path) -> dict:
    sass = functions_by_arch(cuobjdump, lib, "sass")
    ptx = functions_by_arch(cuobjdump, lib, "ptx")
    marlin_ptx = {n for names in ptx.values() for n in names if MARLIN.search(n)}
    marlin_sm12 = {n for a, names in sass.items() if a.startswith("sm_12") for n in names if MARLIN.search(n)}
    return {
        "sass": {a: len(v) for a, v in sorted(sass.items())},
        "sass_marlin": {a: sum(bool(MARLIN.search(n)) for n in v) for a, v in sorted(sass.items())
                        if any(MARLIN.search(n) for n in v)},
        "ptx": {a.replace("sm_", "compute_"): len(v) for a, v in sorted(ptx.items()) if v},
        "ptx_marlin": {a.replace("sm_", "compute_"): sum(bool(MARLIN.search(n)) for n in v)
                       for a, v in sorted(ptx.items()) if any(MARLIN.search(n) for n in v)},
        "cuda_runtime": cuda_runtime(lib),
        # Marlin kernels a GB10 can only run by JIT-compiling PTX: in PTX, without SM12x SASS
        "marlin_ptx_only_on_sm12x": len(marlin_ptx - marlin_sm12),
        "marlin_sm12x_sass": len(marlin_sm12),
    }


def list_wheel(cuobjdump: str, wheel: Path) -> dict:
    libs = {}
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        for member in sorted(z.namelist()):
            if not member.endswith(".so") or "/third_party/" in member:
                continue
            z.extract(member, tmp)
            desc = describe(cuobjdump, Path(tmp) / member)
            if desc["sass"] or desc["ptx"]:
                libs[member] = desc
            os.unlink(Path(tmp) / member)
    return {"filename": wheel.name, "sha256": sha256_file(wheel), "libraries": libs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuobjdump", required=True, help="path of cuobjdump (nvidia-cuda-cuobjdump wheel)")
    p.add_argument("--wheel-dir", type=Path, default=ROOT / ".cache" / "vllm-wheels-full")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not os.access(args.cuobjdump, os.X_OK):
        print(f"wheel_arch_listing: {args.cuobjdump} is not an executable cuobjdump; "
              "pip install nvidia-cuda-cuobjdump and pass its bin/cuobjdump", file=sys.stderr)
        return 2
    variants = yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_vllm_variants"]
    result = {}
    for _name, conf in sorted(variants.items()):
        wheel = conf.get("wheel")
        if not wheel:
            continue
        path = fetch(wheel["url"], wheel["sha256"], args.wheel_dir)
        result[conf["version"]] = list_wheel(args.cuobjdump, path)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, args.out)
    print(f"wheel_arch_listing: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
