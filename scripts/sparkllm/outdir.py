"""Output directories that are ours or untouched (standard library only).

Every tool that writes a directory marks it with ``.sparkllm-owner.json`` ({"tool": ...}) when it
creates it. Before writing, a tool calls ``check_output_dir``, which refuses (``OutputRefused``, a
one-line message naming the path and the fix):

- an output that is equal to, inside, or contains one of the tool's inputs;
- an output path that exists and is not a directory (a file, a socket, ...);
- an existing non-empty directory that this tool did not create (no marker of its own, and none of
  the tool's older bookkeeping files, which mark outputs written before the marker existed).

``probe_writable`` refuses an output place no file can be created in (a read-only filesystem, an
immutable or unwritable directory), so a tool finds it before its work, not after.

A refusal happens before anything is written, so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from .fileio import write_json_atomic

MARKER = ".sparkllm-owner.json"


class OutputRefused(ValueError):
    """The output path is not the tool's to write; the message names the path and the fix."""


def _resolved(p: Path) -> Path:
    return Path(os.path.realpath(p))


def marker_tool(directory: Path) -> str | None:
    """The tool named by ``directory``'s ownership marker, or None."""
    try:
        doc = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tool = doc.get("tool") if isinstance(doc, dict) else None
    return tool if isinstance(tool, str) else None


def owned_by(directory: Path, tool: str, legacy: Iterable[str] = ()) -> bool:
    """True when ``directory`` carries ``tool``'s marker or one of its legacy bookkeeping files."""
    if marker_tool(directory) == tool:
        return True
    return any((directory / name).exists() for name in legacy)


def made_by_toolkit(directory: Path, legacy: Iterable[str] = ()) -> bool:
    """True when any toolkit tool marked ``directory`` (or a legacy bookkeeping file is present)."""
    return marker_tool(directory) is not None or any((directory / n).exists() for n in legacy)


def check_overlap(out: Path, inputs: Sequence[tuple[str, Path]], flag: str) -> None:
    """Refuse an output equal to, inside, or containing an input."""
    out_r = _resolved(out)
    for name, inp in inputs:
        inp_r = _resolved(inp)
        if out_r == inp_r:
            raise OutputRefused(
                f"{out}: {flag} is the input {name} itself; writing there would destroy it: "
                f"choose a new directory for {flag}"
            )
        if inp_r in out_r.parents:
            raise OutputRefused(
                f"{out}: {flag} is inside the input {name} ({inp}); choose a directory outside it"
            )
        if out_r in inp_r.parents:
            raise OutputRefused(
                f"{out}: {flag} contains the input {name} ({inp}); replacing it would destroy the input: "
                f"choose a directory that does not hold {inp}"
            )


def check_output_dir(
    out: Path,
    tool: str,
    inputs: Sequence[tuple[str, Path]] = (),
    flag: str = "--out",
    legacy: Iterable[str] = (),
) -> bool:
    """Refuse an output ``tool`` may not write; True when ``out`` is ``tool``'s own earlier output."""
    check_overlap(out, inputs, flag)
    if out.is_symlink() and not out.exists():
        raise OutputRefused(f"{out}: {flag} is a dangling symbolic link; remove it or choose another path")
    if out.exists() and not out.is_dir():
        raise OutputRefused(
            f"{out}: {flag} exists and is not a directory; choose a new directory (the file was not touched)"
        )
    if not out.is_dir():
        return False
    if owned_by(out, tool, legacy):
        return True
    try:
        with os.scandir(out) as entries:
            empty = next(entries, None) is None
    except OSError as exc:
        raise OutputRefused(
            f"{out}: {flag} cannot be read ({exc.strerror}); choose another directory"
        ) from None
    if not empty:
        other = marker_tool(out)
        made = f"was created by {other}" if other else f"was not created by {tool} (no {MARKER})"
        raise OutputRefused(
            f"{out}: {flag} is a non-empty directory that {made}; it is left as it is: "
            f"choose a new or empty directory"
        )
    return False


def probe_writable(path: Path, flag: str = "--out") -> None:
    """Refuse an output place no file can be written to, before any work: a temporary file is created and
    removed in ``path`` (a directory) or, while it does not exist yet, in its nearest existing parent
    (where it would be made). A read-only filesystem, an immutable directory, missing permissions or a
    parent that is a file are found here, not after hours of work."""
    place = path
    while not place.exists() and not place.is_symlink() and place.parent != place:
        place = place.parent
    where = "" if place == path else f" (it would be made in {place})"
    if not place.is_dir():
        raise OutputRefused(f"{path}: {flag} cannot be made: {place} is not a directory; choose another path")
    try:
        fd, name = tempfile.mkstemp(prefix=".sparkllm-probe-", dir=place)
    except OSError as exc:
        raise OutputRefused(
            f"{path}: {flag} cannot be written{where}: {exc.strerror} [Errno {exc.errno}]; choose a "
            f"writable directory for {flag} (or make this one writable: a read-only filesystem, "
            f"permissions, chattr +i)"
        ) from None
    os.close(fd)
    os.unlink(name)


def write_marker(directory: Path, tool: str) -> None:
    """Mark ``directory`` as ``tool``'s output (atomic; kept when already there)."""
    if marker_tool(directory) == tool:
        return
    write_json_atomic(directory / MARKER, {"tool": tool, "created": time.time()})
