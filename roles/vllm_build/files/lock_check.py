"""The image's Python set against its lock: run by templates/Dockerfile.j2 after each stage's pip install.

    python3 lock_check.py [--also NAME]... LOCK_FILE...

LOCK_FILE: requirement files of roles/vllm_build/files/locks/<variant>/ (``name==version``, hashes ignored
here: pip checked them at install), in install order; a later file's version of a name replaces an earlier
one's. Every distribution installed in this interpreter's environment must be:

- in the lock, at the locked version; or
- named by ``--also`` (what the build itself makes or verifies another way: the vLLM wheel, pinned by its
  commit or its sha256); or
- pinned with ``==`` by an installed locked distribution's own Requires-Dist (a torch wheel of the PyTorch
  index that the lock could not read pins its CUDA libraries so), reported by name.

And every locked name must be installed. Standard library only (it runs in the image). Exit status: 0 the
set is the lock, 1 it is not (each difference printed), 2 usage.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
# "name (==1.2)" / "name==1.2 ; marker" in Requires-Dist (extras in brackets allowed)
EXACT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*"
                   r"\(?\s*===?\s*([^\s,;()]+)\s*\)?\s*(?:;|$)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(paths: list[Path]) -> dict[str, str]:
    locked: dict[str, str] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            m = PIN.match(line.strip())
            if m:
                locked[normalize(m.group(1))] = m.group(2)
    return locked


def installed() -> dict[str, metadata.Distribution]:
    return {normalize(d.metadata["Name"]): d for d in metadata.distributions() if d.metadata["Name"]}


def exact_pins(dist: metadata.Distribution) -> dict[str, str]:
    """{name: version} of the ``==`` requirements of a distribution (markers not evaluated)."""
    out = {}
    for req in dist.requires or []:
        m = EXACT.match(req)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def check(locked: dict[str, str], dists: dict[str, metadata.Distribution],
          also: set[str]) -> tuple[list, list]:
    """(problems, packages accepted as ==-pinned by a locked dependent)."""
    problems, pinned_by = [], []
    for name, version in sorted(locked.items()):
        if name not in dists:
            problems.append(f"{name}=={version} is locked but not installed")
        elif dists[name].version != version:
            problems.append(f"{name} is installed at {dists[name].version}, the lock has {version}")
    for name in sorted(set(dists) - set(locked) - also):
        version = dists[name].version
        by = sorted(dep for dep in locked if dep in dists and exact_pins(dists[dep]).get(name) == version)
        if by:
            pinned_by.append(f"{name}=={version} (pinned by {', '.join(by)})")
        else:
            problems.append(f"{name}=={version} is installed but not in the lock")
    return problems, pinned_by


def main(argv: list[str]) -> int:
    also: set[str] = set()
    files: list[Path] = []
    it = iter(argv)
    for arg in it:
        if arg == "--also":
            also.add(normalize(next(it, "")))
        elif arg.startswith("-"):
            print(__doc__.split("\n\n")[1], file=sys.stderr)
            return 2
        else:
            files.append(Path(arg))
    if not files or not all(f.is_file() for f in files):
        print(f"lock_check: lock files missing: {[str(f) for f in files if not f.is_file()] or 'none given'}",
              file=sys.stderr)
        return 2
    locked = read_lock(files)
    problems, pinned_by = check(locked, installed(), also)
    for p in problems:
        print(f"SPARKLLM-LOCK-MISMATCH: {p}", file=sys.stderr)
    for p in pinned_by:
        print(f"sparkllm: not in the lock, pinned by its dependent: {p}")
    print(f"sparkllm: lock check: {len(locked)} locked, {len(pinned_by)} pinned by dependents, "
          f"{len(problems)} differences ({' '.join(f.name for f in files)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
