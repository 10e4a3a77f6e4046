"""Which of the on-host tools must be copied: those missing on the Spark or differing from the controller's.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom.

``roles/spark_tools`` runs in every stage's play. Copying its ~45 files with one ``copy`` call each cost
about 15 s per play even when nothing changed (a stat and a checksum over the connection per file: 75 of
the 137 s of a check run of site.yml). The role now asks the Spark once for the sha256, mode and owner of
every file (``spark_tools_probe``'s output) and copies only what differs, still with ``copy``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# the toolkit's package (scripts/sparkllm), as filter_plugins/spark_stage.py finds it
_SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if _SCRIPTS not in sys.path:
    sys.path.append(_SCRIPTS)

from sparkllm.fileio import sha256_file  # noqa: E402

# What the Spark answers per file: [sha256, mode (int), uid, gid]; a missing file is absent.
PROBE = """\
import hashlib, json, os, sys
root, out = sys.argv[1], {}
for rel in sys.argv[2:]:
    try:
        with open(os.path.join(root, rel), "rb") as f:
            st = os.fstat(f.fileno())
            out[rel] = [hashlib.sha256(f.read()).hexdigest(), st.st_mode & 0o7777, st.st_uid, st.st_gid]
    except OSError:
        pass
print(json.dumps(out))
"""


def spark_tools_files(scripts_dir: str, scripts: Sequence[str]) -> list[dict]:
    """What the role copies: each listed tool of ``scripts_dir`` (mode 0755), then every module of its
    ``sparkllm`` package and of its subpackages (0644, sorted by path), as {src, dest, mode}."""
    if isinstance(scripts, (str, bytes)) or not all(isinstance(s, str) for s in scripts):
        raise ValueError(f"spark_tools_scripts must be a list of file names, got {scripts!r}")
    root = Path(scripts_dir)
    missing = [s for s in scripts if not (root / s).is_file()]
    if missing:
        raise ValueError(f"spark_tools_scripts names files that are not in {root}: {', '.join(missing)}")
    out = [{"src": str(root / s), "dest": s, "mode": "0755"} for s in scripts]
    out += [{"src": str(p), "dest": p.relative_to(root).as_posix(), "mode": "0644"}
            for p in sorted((root / "sparkllm").rglob("*.py")) if "__pycache__" not in p.parts]
    return out


def spark_tools_dirs(files: Sequence[Mapping[str, Any]], base: str) -> list[str]:
    """The directories under ``base`` the entries of ``files`` need (``sparkllm`` and its subpackages),
    parents first, for the role to create before it copies."""
    dirs = {str(parent) for f in files for parent in Path(f["dest"]).parents if str(parent) != "."}
    return [f"{base.rstrip('/')}/{d}" for d in sorted(dirs, key=lambda d: (d.count("/"), d))]


def spark_tools_stale(files: Sequence[Mapping[str, Any]], present: Mapping[str, Sequence[Any]]) -> list[dict]:
    """The entries of ``files`` ({src: controller path, dest: path under the tools directory, mode: "0755"})
    whose copy on the Spark is missing, differs in content, or is not root's with that mode."""
    if isinstance(files, (str, bytes)) or not isinstance(present, Mapping):
        raise ValueError(f"spark_tools_stale wants a list of files and the probe's mapping, got "
                         f"{type(files).__name__} and {type(present).__name__}")
    stale = []
    for f in files:
        want = [sha256_file(f["src"]), int(str(f["mode"]), 8), 0, 0]
        got = present.get(f["dest"])
        if got is None or list(got) != want:
            stale.append(dict(f))
    return stale


def spark_tools_probe(_: Any = None) -> str:
    """The probe's source, for ``python3 -c`` on the Spark (its arguments: the directory, then the files)."""
    return PROBE


class FilterModule:
    """Ansible filters: spark_tools_files, spark_tools_dirs, spark_tools_stale, spark_tools_probe."""

    def filters(self):
        return {"spark_tools_files": spark_tools_files, "spark_tools_dirs": spark_tools_dirs,
                "spark_tools_stale": spark_tools_stale, "spark_tools_probe": spark_tools_probe}
