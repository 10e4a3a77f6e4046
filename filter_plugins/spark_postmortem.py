"""Why a server did not come up: the first EngineCore traceback of its journal, and the memory picture.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom. The serve
role's rollback path uses both in the failure message (roles/serve/tasks/switch.yml).

vLLM runs the engine in a child process. When it fails to start, the child logs the root cause as
``EngineCore failed to start.`` followed by a traceback, every line prefixed like
``(EngineCore_DP0 pid=123) ERROR 11-30 12:00:00 [core.py:843] ``; the API server then fails with a
second, uninformative traceback (``Engine core initialization failed. See root cause above``), and
the journal's last lines are usually the teardown. The first EngineCore traceback is the one to read.
"""

from __future__ import annotations

import re

TRACEBACK = "Traceback (most recent call last):"
_CHAIN = ("The above exception was the direct cause", "During handling of the above exception")
# /proc/meminfo fields shown, in this order (GB10: unified memory, so MemAvailable is what the GPU can get).
MEMINFO_FIELDS = ("MemTotal", "MemAvailable", "MemFree", "Cached", "Shmem", "SwapTotal", "SwapFree",
                  "HugePages_Total")
_MEMINFO_LINE = re.compile(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+kB)?\s*$")


def _lines(text_or_lines) -> list[str]:
    if text_or_lines is None:
        return []
    if isinstance(text_or_lines, str):
        return text_or_lines.splitlines()
    return [str(line) for line in text_or_lines]


def _block(lines: list[str], start: int, prefix: str) -> list[str]:
    """The traceback whose header is lines[start], without the per-line prefix; chained ones included.

    It ends after the exception line (plus, for prefixed log records, further unindented lines of a
    multi-line message), unless "The above exception was the direct cause ..." chains another one.
    """
    out = [TRACEBACK]
    state = "frames"  # frames -> exception -> (chain -> frames ...)
    pending: list[str] = []
    for line in lines[start + 1:]:
        if not line.startswith(prefix):
            break
        body = line[len(prefix):]
        if state == "frames":
            out.append(body)
            if body.strip() and not body[0].isspace():
                state = "exception"
            continue
        if not body.strip():
            pending.append(body)
            continue
        if body.startswith(_CHAIN):
            out += pending + [body]
            pending, state = [], "chain"
            continue
        if body.startswith(TRACEBACK):
            if state != "chain":
                break  # a separate traceback
            out += pending + [body]
            pending, state = [], "frames"
            continue
        if state == "exception" and prefix and not pending and not body[0].isspace():
            out.append(body)
            continue
        break
    return out


def _is_engine_core(lines: list[str], index: int, prefix: str, marker: str) -> bool:
    if marker in prefix:
        return True
    return any(marker in line for line in lines[max(0, index - 3):index])


def spark_first_traceback(journal, marker: str = "EngineCore", max_lines: int = 60) -> dict:
    """The first traceback of ``marker``'s process in ``journal`` (text or list of lines).

    Returns ``{"found": "EngineCore" | "other" | "", "text": ...}``: the first traceback logged by
    (or right after a line naming) ``marker``; if there is none, the first traceback of any kind
    (found "other"); "" and no text when the journal has no traceback. Per-line log prefixes are
    removed; a long traceback keeps its first 5 and last ``max_lines - 6`` lines.
    """
    lines = _lines(journal)
    first_any: tuple[int, str] | None = None
    chosen: tuple[int, str] | None = None
    for i, line in enumerate(lines):
        pos = line.find(TRACEBACK)
        if pos < 0:
            continue
        prefix = line[:pos]
        if first_any is None:
            first_any = (i, prefix)
        if _is_engine_core(lines, i, prefix, marker):
            chosen = (i, prefix)
            break
    found = marker if chosen else ("other" if first_any else "")
    chosen = chosen or first_any
    if chosen is None:
        return {"found": "", "text": ""}
    block = _block(lines, *chosen)
    if len(block) > max_lines:
        keep_tail = max(1, max_lines - 6)
        left_out = len(block) - 5 - keep_tail
        block = block[:5] + [f"  ... ({left_out} lines left out)"] + block[-keep_tail:]
    return {"found": found, "text": "\n".join(block)}


def _gib(kib: int) -> str:
    return f"{kib / (1024 * 1024):.1f} GiB"


def spark_meminfo_summary(meminfo) -> str:
    """One line from /proc/meminfo (text or lines): the fields in MEMINFO_FIELDS, in GiB."""
    values: dict[str, int] = {}
    for line in _lines(meminfo):
        m = _MEMINFO_LINE.match(line.strip())
        if m:
            values[m.group(1)] = int(m.group(2))
    parts = []
    for name in MEMINFO_FIELDS:
        if name not in values:
            continue
        parts.append(f"{name} {values[name]}" if name.startswith("HugePages")
                     else f"{name} {_gib(values[name])}")
    return ", ".join(parts) if parts else "(no /proc/meminfo figures)"


class FilterModule:
    """Ansible filters: spark_first_traceback, spark_meminfo_summary."""

    def filters(self):
        return {
            "spark_first_traceback": spark_first_traceback,
            "spark_meminfo_summary": spark_meminfo_summary,
        }
