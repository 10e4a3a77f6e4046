"""The diffs of the upstream vLLM commits our builds carry (spark_vllm_variants.<v>.extra_prs entries with
``diff_sha256``), made the way the image build makes them and kept per machine.

The build (templates/Dockerfile.j2, stage build) fetches the entry's commit by SHA, runs
``git diff <vllm_build_pr_diff_args> <sha>^1 <sha>``, refuses bytes whose sha256 is not ``diff_sha256``,
applies the entry's literal ``rewrite`` pairs and ``git apply``s the result to the release tree. This module
makes the same diff once (a two-commit shallow fetch of ``vllm_build_repo_url`` into a temporary bare
repository, the role's own diff options), checks the same sha256 and keeps it in the machine cache
(``~/.cache/sparkllm/vllm-prs/pr<N>-<sha>.diff``): a second call finds it and fetches nothing.
tests/contract/test_upstream_pr_diffs_contract.py applies it to the release's real source (the pinned sdist).

tests/contract/setup_vllm_env.sh runs it as ``python tests/contract/vllm_prs.py`` (exit 0 done, 1 a hash
failed, 2 usage; github.com unreachable is a warning, exit 0, and the diff tests skip saying so). Needs git
and github.com the first time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from sparkllm.fileio import sha256_file  # noqa: E402  (the project's one sha256 of a file)
from sparkllm.lock.sources import MACHINE_CACHE  # noqa: E402

METHODS = ROOT / "group_vars" / "all" / "methods.yml"
DEFAULTS = ROOT / "roles" / "vllm_build" / "defaults" / "main.yml"
CACHE = MACHINE_CACHE / "vllm-prs"


def diff_prs() -> list[tuple[str, dict]]:
    """(variant, entry) for every extra_prs entry carried as a diff, in catalogue order."""
    variants = yaml.safe_load(METHODS.read_text())["spark_vllm_variants"]
    return [(name, p) for name, conf in variants.items() for p in conf.get("extra_prs") or []
            if isinstance(p, dict) and "diff_sha256" in p]


def role_defaults() -> dict:
    return yaml.safe_load(DEFAULTS.read_text())


def rewritten(text: str, rewrite: list[list[str]] | None) -> str:
    """The diff after the entry's literal renames, in order (what the build's python3 -c does)."""
    for old, new in rewrite or []:
        text = text.replace(old, new)
    return text


def touched(diff_text: str) -> list[str]:
    """The paths a git diff changes (its ``diff --git a/X b/X`` headers), in order."""
    return [line.split(" b/", 1)[1] for line in diff_text.splitlines() if line.startswith("diff --git a/")]


class Unreachable(RuntimeError):
    """The commit could not be fetched (no network to github.com, or the host refused): nothing is known
    about the pin, which is not the same as a diff whose hash differs."""


def _git(*args: str, cwd: Path) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def pr_diff(entry: dict) -> Path:
    """The entry's upstream diff in the machine cache, made when missing and checked against diff_sha256."""
    pr, sha, want = entry["pr"], entry["sha"], entry["diff_sha256"]
    dest = CACHE / f"pr{pr}-{sha}.diff"
    if dest.exists() and sha256_file(dest) == want:
        return dest
    defaults = role_defaults()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".pr{pr}-") as tmp:
        repo = Path(tmp) / "git"
        repo.mkdir()
        _git("init", "-q", "--bare", cwd=repo)
        try:
            _git("fetch", "-q", "--depth=2", defaults["vllm_build_repo_url"], sha, cwd=repo)
        except RuntimeError as exc:
            raise Unreachable(str(exc)) from None
        out = Path(tmp) / "pr.diff"
        out.write_bytes(subprocess.run(
            ["git", "diff", *defaults["vllm_build_pr_diff_args"], f"{sha}^1", sha],
            cwd=repo, capture_output=True, check=True).stdout)
        got = sha256_file(out)
        if got != want:
            raise RuntimeError(f"the diff of PR #{pr}'s commit {sha} has sha256 {got}, {METHODS.name} pins "
                               f"{want}: the commit or vllm_build_pr_diff_args changed; check both, "
                               "then the pin")
        os.replace(out, dest)
    return dest


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python tests/contract/vllm_prs.py   (no arguments: every diff-carried PR of the "
              "catalogue)", file=sys.stderr)
        return 2
    for variant, entry in diff_prs():
        try:
            print(f"vllm_prs: {variant}: PR #{entry['pr']}: {pr_diff(entry)}")
        except Unreachable as exc:
            # a machine without github.com (a CI runner behind a package mirror) can still run every other
            # contract test: the diff's own tests skip, saying why; a hash that differs is still a failure
            print(f"vllm_prs: warning: {variant}: PR #{entry['pr']}: cannot fetch its commit ({exc}); the "
                  "contract tests of carried diffs will be skipped on this machine until github.com is "
                  "reachable once", file=sys.stderr)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"vllm_prs: {variant}: PR #{entry['pr']}: {exc}; it needs git and github.com once "
                  "(then the machine cache has it)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
