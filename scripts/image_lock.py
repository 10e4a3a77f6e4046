"""Lock the whole Python set of each vLLM image variant, for the Spark (Linux aarch64, CPython 3.12).

What each stage of templates/Dockerfile.j2 installs (the one description of it is
scripts/sparkllm/lock/resolve.py ``install_sets``, which tests/unit/test_resolve_inputs.py holds to
the rendered Dockerfile) is resolved by pip's own resolver, dry run, for the target (``--platform``
manylinux_2_39_aarch64 and every older tag glibc 2.39 accepts, ``--python-version 3.12
--only-binary=:all:``, markers answered for Linux aarch64 CPython 3.12.3), and written as pip requirement
files with the sha256 of the wheel pip picked, one directory per variant:

    roles/vllm_build/files/locks/<variant>/base.txt            pip, triton, torch's dependencies
    roles/vllm_build/files/locks/<variant>/base-index.txt      PyTorch-index packages not hashed here
    roles/vllm_build/files/locks/<variant>/build.txt           the release's build requirements, less base
    roles/vllm_build/files/locks/<variant>/runtime-source.txt  the compiled wheel's requirements + Ray +
                                                               fastsafetensors, less base
    roles/vllm_build/files/locks/<variant>/runtime-wheel.txt   the same for the pinned upstream wheel
    roles/vllm_build/files/locks/<variant>/flashinfer.txt      flashinfer-python for the AOT stage, less base

The image's final set (the runtime stage of the variant's install mode) is resolved first, then base under
its versions (so base installs what the runtime keeps), then the other stages under base's versions; a
stage file lists what that stage adds or replaces (a build requirement may need another setuptools).
The image installs each file with ``pip install --no-deps --require-hashes`` and ends with ``pip check``
and the lock check (roles/vllm_build/files/lock_check.py).

torch, torchvision and torchaudio are the CUDA 13 builds. Where the variant's toolchain pins them by their
public version (PyPI's aarch64 wheel is that build: torch 2.11.0), they come from PyPI and are locked with
their hashes and their CUDA dependencies like everything else; the PyTorch index is not asked and
base-index.txt lists nothing. Where it pins the ``+cu130`` local version (only the PyTorch index,
``vllm_build_torch_index_url``, has that build: PyPI's aarch64 torch 2.10.0 is a CPU build), that index is
used: where it is reachable they are hashed too (and base-index.txt is empty); where it is not (the
development machines of this project), they are written to base-index.txt by exact version without a hash,
the rest of the base set is resolved from PyPI at their public versions, and the image's lock check accepts
only packages such a torch wheel pins with ``==`` beside the lock (its nvidia-* CUDA libraries); the header
of base-index.txt says so.

    python scripts/image_lock.py [--check] [VARIANT ...]     (make lock)

Exit status: 0 written (or, with --check, the checked-in lock is what its inputs give), 1 a set does not
resolve, PyPI was not reached or --check found a stale lock, 2 usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sparkllm.cli import UsageError, WorkFailed, doc_parser, run_main
from sparkllm.fileio import atomic_write

# the description of what each stage installs, and pip's target settings, live with the resolver the
# contract suite runs (scripts/sparkllm/lock/resolve.py): one place, held to the Dockerfile by
# tests/unit/test_resolve_inputs.py
from sparkllm.lock import resolve as rr

ROOT = Path(__file__).resolve().parents[1]

LOCKS = ROOT / "roles" / "vllm_build" / "files" / "locks"
TARGET = "linux_aarch64, CPython 3.12 (glibc 2.39: Ubuntu 24.04, the base image's python3)"
# the index packages: pinned with a local version label (+cu130), only on vllm_build_torch_index_url
LOCAL_LABEL = re.compile(r"\+[A-Za-z0-9.]+$")
STAGES = ("base", "build", "runtime-source", "runtime-wheel", "flashinfer")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str  # "" when not hashed here (an index package, index unreachable)
    url: str

    def line(self) -> str:
        if not self.sha256:
            return f"{self.name}=={self.version}"
        return f"{self.name}=={self.version} \\\n    --hash=sha256:{self.sha256}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dry_run(args: list[str], constraints: list[str], index_ok: bool) -> dict[str, Pin]:
    """pip's resolution of ``args`` under ``constraints`` for the target: {normalized name: Pin}."""
    with tempfile.TemporaryDirectory(prefix="image-lock-") as tmp:
        work = Path(tmp)
        (work / "constraints.txt").write_text("\n".join(constraints) + "\n")
        cmd = [sys.executable, "-c", rr.BOOT, json.dumps(rr.TARGET_ENV), "install", "--dry-run",
               "--report", str(work / "report.json"), "--ignore-installed", "--only-binary=:all:",
               *(a for p in rr.PLATFORMS for a in ("--platform", p)), "--python-version", "3.12",
               "--implementation", "cp", "--target", str(work / "target"), "--use-feature=fast-deps",
               "--no-cache-dir", "--index-url", rr.PYPI,
               *(["--extra-index-url", rr.torch_index()] if index_ok else []),
               "-c", str(work / "constraints.txt"), *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=rr._pip_env(), check=False)
        if res.returncode != 0:
            said = [line for line in (res.stdout + "\n" + res.stderr).splitlines()
                    if line.strip() and "fast-deps" not in line and not rr.PROGRESS.match(line)]
            raise RuntimeError("\n".join(said)[-3000:])
        report = json.loads((work / "report.json").read_text())
    pins = {}
    for item in report["install"]:
        meta, info = item["metadata"], item.get("download_info", {})
        hashes = info.get("archive_info", {}).get("hashes", {})
        pins[normalize(meta["name"])] = Pin(normalize(meta["name"]), meta["version"],
                                            hashes.get("sha256", ""), info.get("url", ""))
    return pins


def _requirement_args(variant: str, conf: dict, work: Path) -> dict[str, list[str]]:
    """{stage: pip arguments} of one variant (the resolver's install sets, plus pip itself in base)."""
    sets = rr.install_sets(variant, conf, work)
    base = ["pip", *rr.base_names(conf)]
    out = {"base": base, "build": sets["build"], "runtime-source": sets["runtime-source"]}
    if "runtime-wheel" in sets:
        out["runtime-wheel"] = sets["runtime-wheel"]
    elif conf.get("wheel"):  # install: source today, but the pinned wheel is one setting away
        out["runtime-wheel"] = [*rr.base_names(conf), f"vllm @ {conf['wheel']['url']}",
                                *(e.strip('"') for e in rr.RUNTIME_EXTRAS)]
    # the FlashInfer AOT stage (FROM base): flashinfer-python and what it needs, at the runtime's versions
    out["flashinfer"] = [*rr.base_names(conf), "flashinfer-python"]
    return out


def _pins(pins: dict[str, Pin], skip: set[str]) -> list[str]:
    return [f"{p.name}=={p.version}" for p in pins.values() if p.name not in skip]


def index_packages(conf: dict) -> set[str]:
    """The variant's PyTorch-index packages: those its toolchain pins with a local version label (+cu130)."""
    return {normalize(line.split("==")[0]) for line in rr.constraints_lines(conf) if LOCAL_LABEL.search(line)}


def lock_variant(variant: str, conf: dict, index_ok: bool) -> dict[str, list[Pin]]:
    """{file stem: pins} of one variant: base, base-index and each later stage less the base set.

    ``index_ok``: the PyTorch index is used (the variant has index packages and the index answers)."""
    toolchain = rr.constraints_lines(conf)
    index_names = index_packages(conf)
    constraints = toolchain if index_ok else rr.public_pins(toolchain)
    primary = "runtime-wheel" if conf.get("install") == "wheel" else "runtime-source"
    with tempfile.TemporaryDirectory(prefix="image-lock-src-") as tmp:
        args = _requirement_args(variant, conf, Path(tmp))
        # the image's final set first, then base under its versions (so base already has what the runtime
        # stage keeps, e.g. vLLM's setuptools<81), then the other stages under base's versions
        final = _dry_run(args[primary], constraints, index_ok)
        base = _dry_run(args["base"], [*constraints, *_pins(final, index_names)], index_ok)
        later = {primary: final}
        for stage in STAGES[1:]:
            if stage in args and stage != primary:
                under = _pins(final, index_names) if stage == "flashinfer" else []
                try:
                    later[stage] = _dry_run(args[stage], [*constraints, *under, *_pins(base, index_names)],
                                            index_ok)
                except RuntimeError:  # this stage needs other versions of base packages: it replaces them
                    later[stage] = _dry_run(args[stage], constraints, index_ok)
    out: dict[str, list[Pin]] = {"base": [], "base-index": []}
    exact = {normalize(line.split("==")[0]): line.split("==")[1] for line in toolchain}
    for name, pin in sorted(base.items()):
        if name in index_names and not index_ok:
            out["base-index"].append(Pin(name, exact[name], "", ""))
        else:
            out["base"].append(pin)
    for stage in STAGES[1:]:
        if stage in later:
            pins = later[stage]
            # what base already has at the same version is not installed again; another version replaces it
            out[stage] = [pins[n] for n in sorted(pins) if n != "vllm" and n not in index_names
                          and (n not in base or base[n].version != pins[n].version)]
    missing = [p.name for pins in out.values() for p in pins if not p.sha256 and p.name not in index_names]
    if missing:
        raise RuntimeError(f"{variant}: pip reported no sha256 for {', '.join(missing)}")
    return out


def inputs_digest(variant: str, conf: dict, index_ok: bool) -> str:
    """sha256 of what the lock depends on: the toolchain pins, each stage's requirement lines, the target,
    pip's version and the index mode. tests/unit/test_image_lock.py recomputes it offline."""
    with tempfile.TemporaryDirectory(prefix="image-lock-key-") as tmp:
        args = _requirement_args(variant, conf, Path(tmp))
        material = {stage: [a if not Path(a).is_absolute() else rr._flatten(Path(a)) for a in argv]
                    for stage, argv in args.items()}
    doc = {"toolchain": rr.constraints_lines(conf), "sets": material, "platforms": rr.PLATFORMS,
           "env": rr.TARGET_ENV, "index": rr.torch_index(), "index_reachable": index_ok}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def render(variant: str, stem: str, pins: list[Pin], digest: str, index_ok: bool) -> str:
    head = [f"# Lock of the vLLM image variant {variant}, file {stem}, for {TARGET}.",
            f"# Generated by scripts/image_lock.py (make lock) with pip {rr.pip_version()}; do not edit.",
            f"# inputs sha256: {digest}"]
    if stem == "base-index":
        if not pins and not index_ok:
            head += ["# Nothing: this variant pins torch, torchvision and torchaudio by their public",
                     "# version, PyPI's aarch64 wheels of the CUDA 13 build; they and their CUDA",
                     "# dependencies are hashed in base.txt, and the PyTorch index is not used."]
        elif index_ok:
            head.append(f"# {rr.torch_index()} was reachable: its packages are hashed in base.txt.")
        else:
            head += [f"# From {rr.torch_index()}, by exact version only: that index was unreachable when",
                     "# this lock was made, so their hashes and their own ==-pinned CUDA dependencies are",
                     "# not recorded here (the image's lock check accepts only such ==-pinned dependencies).",
                     "# Run `make lock` where the index is reachable to hash them."]
    return "\n".join(head + [p.line() for p in pins]) + "\n"


def parser() -> argparse.ArgumentParser:
    p = doc_parser("image_lock.py", __doc__)
    p.add_argument("variants", nargs="*", help="variants of spark_vllm_variants (default: all)")
    p.add_argument("--check", action="store_true",
                   help="fail when the checked-in lock's inputs digest is not what its inputs give now")
    return p


def lock(args: argparse.Namespace) -> int:
    known = rr.variants()
    unknown = [v for v in args.variants if v not in known]
    if unknown:
        raise UsageError(f"no variant {', '.join(unknown)} in {rr.METHODS}")
    status = 0
    for variant in args.variants or sorted(known):
        conf = known[variant]
        # the PyTorch index only for a variant that pins an index build (+cu130); otherwise PyPI alone
        use_index = bool(index_packages(conf)) and rr.index_reachable(rr.torch_index())
        digest = inputs_digest(variant, conf, use_index)
        outdir = LOCKS / variant
        if args.check:
            heads = [f.read_text().split("\n", 3)[2] for f in sorted(outdir.glob("*.txt"))]
            stale = not heads or any(h != f"# inputs sha256: {digest}" for h in heads)
            print(f"image_lock: {variant}: {'STALE: run make lock' if stale else 'up to date'}")
            status = 1 if stale else status
            continue
        try:
            files = lock_variant(variant, conf, use_index)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            raise WorkFailed(f"{variant}: {exc}") from None
        outdir.mkdir(parents=True, exist_ok=True)
        for old in outdir.glob("*.txt"):
            if old.stem not in files:
                old.unlink()
        for stem, pins in files.items():
            with atomic_write(outdir / f"{stem}.txt") as f:
                f.write(render(variant, stem, pins, digest, use_index).encode())
        counts = ", ".join(f"{stem} {len(pins)}" for stem, pins in files.items())
        print(f"image_lock: {variant}: {counts} packages -> {outdir.relative_to(ROOT)}")
    return status


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_main("image_lock", lambda: lock(args))


if __name__ == "__main__":
    sys.exit(main())
