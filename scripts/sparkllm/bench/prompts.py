"""bench: prompt sets (our JSONL) and the Spec-Bench download (standard library only)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkllm.bench.common import UsageError
from sparkllm.fileio import sha256_file, write_bytes_atomic

UNPINNED = "TO-BE-FILLED"




@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: list[dict[str, str]]
    # this prompt's own token limit (a prompt file's optional "max_tokens"; None: the run's --max-tokens)
    max_tokens: int | None = None
    # later user turns of an agent conversation (optional "followups": the agent profile sends them one
    # by one, each after the previous answer, so every turn shares the growing prefix)
    followups: tuple[str, ...] = ()


def _prompt(obj: dict[str, Any]) -> Prompt:
    """One prompt line's object -> Prompt; ValueError/KeyError/TypeError naming a bad field."""
    limit = obj.get("max_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"max_tokens {limit!r} is not a positive integer")
    follow = obj.get("followups") or []
    if not isinstance(follow, list) or not all(isinstance(x, str) and x.strip() for x in follow):
        raise ValueError("followups must be a list of non-empty strings")
    return Prompt(str(obj["id"]), str(obj["category"]), list(obj["messages"]), limit, tuple(follow))


def load_prompts(path: Path, category: str | None = None) -> tuple[list[Prompt], str]:
    """Read a JSONL prompt set; return (prompts, sha256 of the file bytes)."""
    if not path.is_file():
        raise UsageError(f"prompt file {path} not found: pass --prompts FILE (JSONL with id, category, "
                         "messages) or run fetch-prompts first")
    raw = path.read_bytes()
    prompts: list[Prompt] = []
    for no, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            p = _prompt(obj)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"{path}:{no}: bad prompt line ({exc}); expected JSON with id, category, "
                             "messages (optional: max_tokens, a positive integer; followups, a list of "
                             "strings)") from exc
        if not p.messages or p.messages[-1].get("role") != "user":
            raise UsageError(f"{path}:{no}: prompt {p.id} must end with a user message")
        prompts.append(p)
    if category:
        wanted = set(category.split(","))
        prompts = [p for p in prompts if p.category in wanted]
    if not prompts:
        raise UsageError(f"no prompts selected from {path} (category filter: {category!r})")
    return prompts, hashlib.sha256(raw).hexdigest()




def convert_specbench(src: Path, dest: Path) -> int:
    """Spec-Bench question.jsonl ({question_id, category, turns[]}) -> our JSONL (first turn only)."""
    lines = []
    for no, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turn = q["turns"][0]
            lines.append(json.dumps({"id": f"specbench-{q['question_id']}", "category": str(q["category"]),
                                     "messages": [{"role": "user", "content": turn}]}))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise SystemExit(f"{src}:{no}: not a Spec-Bench question line ({exc})") from exc
    write_bytes_atomic(dest, ("\n".join(lines) + "\n").encode("utf-8"))
    return len(lines)


def fetch_prompts(manifest: dict[str, Any], dest: Path, url: str | None = None, sha256: str | None = None,
                  allow_unpinned: bool = False) -> int:
    """Download, verify the sha256, convert. Refuses an unpinned or mismatching file."""
    commit = manifest.get("commit", UNPINNED)
    want = (sha256 or manifest.get("sha256") or UNPINNED).lower()
    pinned = UNPINNED.lower() not in want and UNPINNED not in commit
    if url is None:
        url = manifest["url_template"].format(commit=commit if UNPINNED not in commit else "main")
    if not pinned and not allow_unpinned:
        raise SystemExit(f"{manifest.get('name', 'prompt source')} is not pinned (commit/sha256 to be filled "
                         "in scripts/prompts/specbench.json): fill them, pass --sha256, or --allow-unpinned")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmpname = tempfile.mkstemp(prefix=".download.", dir=dest.parent)
    tmp = Path(tmpname)
    try:
        with os.fdopen(fd, "wb") as fh, urllib.request.urlopen(url, timeout=120) as r:  # noqa: S310
            shutil.copyfileobj(r, fh)
        got = sha256_file(tmp)
        if pinned and got != want:
            raise SystemExit(f"sha256 mismatch for {url}: expected {want}, got {got}; refusing to use it "
                             "(wrong commit or tampered download)")
        if not pinned:
            print(f"WARNING: unpinned download, sha256 {got}: pin it in specbench.json", file=sys.stderr)
        lines = manifest.get("lines")
        if pinned and sha256 is None and isinstance(lines, int):
            n = sum(1 for line in tmp.read_text(encoding="utf-8").splitlines() if line.strip())
            if n != lines:
                raise SystemExit(f"{url}: {n} questions, the pinned file has {lines}; refusing to use it")
        return convert_specbench(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
