#!/usr/bin/env python3
"""The molecule scenarios a change touches (``make test-affected``): given changed paths, which scenarios
can their change break.

What a scenario runs is read from its own files, not listed by hand: the plays of ``molecule/<s>/*.yml``
(converge, prepare, cleanup, ...), the playbooks they import (``site.yml`` and ``playbooks/*.yml``), the roles
those run (``roles:``, ``import_role``/``include_role``, meta dependencies, a role that includes another).
A changed path maps to scenarios so:

* ``molecule/<s>/...``: that scenario; ``roles/<r>/...``: every scenario that runs role r; a playbook (or
  ``site.yml``): every scenario that imports it;
* a file under ``templates/``, ``tests/fixtures/`` (the stand-ins, the generated checkpoints) or
  ``tests/harness/``: every scenario whose roles, playbooks or own files name it (its file name, or for a
  fixture the top name under tests/fixtures/); when none does, every scenario (it may be reached another way);
* text no scenario runs (``*.md``, ``docs/``, ``tests/unit|contract|perf/``, ``.ci/``, this module): none;
* anything else (``group_vars/``, ``filter_plugins/``, ``library/``, ``scripts/``, ``molecule/_shared/``,
  ``ansible.cfg``, ``requirements.txt``, ``playbooks/vars/``, a new top-level path): every scenario.

The changed paths are ``git diff --name-only --no-renames $(git merge-base HEAD BASE)`` (the commits since
BASE and the working tree's uncommitted changes) plus the untracked files; BASE defaults to ``HEAD``, so by
default it is the work not yet committed. ``--paths`` takes the paths instead of git.

    .venv/bin/python tests/harness/affected.py site serve ops            # scenarios of the work tree's change
    .venv/bin/python tests/harness/affected.py --base origin/main site serve
    .venv/bin/python tests/harness/affected.py --paths roles/serve/tasks/main.yml -- site serve bench

Prints the affected scenarios among those given, in their order, one line, space-separated (empty when
none). Exit status: 0 done, 1 git failed, 2 usage (an unknown scenario, a BASE git does not know).
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE_ACTIONS = {f"{p}{a}" for p in ("", "ansible.builtin.") for a in ("import_role", "include_role")}
PLAYBOOK_ACTIONS = {"import_playbook", "ansible.builtin.import_playbook"}
TASK_LISTS = ("pre_tasks", "tasks", "post_tasks", "handlers", "block", "rescue", "always")
# changes no scenario runs
NONE_PREFIXES = ("docs/", "tests/unit/", "tests/contract/", "tests/perf/", ".ci/",
                 "tests/harness/affected.py", "tests/harness/test_all.sh", "LICENSE", ".gitignore")
# shared files matched to scenarios by name (the rest of the tree reaches every scenario)
NAMED_PREFIXES = ("templates/", "tests/fixtures/", "tests/harness/")


class UsageError(Exception):
    """Bad arguments: exit 2."""


def _load(path: Path):
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def _tasks(node) -> Iterator[dict]:
    """Every task mapping of a task list, the tasks of blocks included."""
    for task in node if isinstance(node, list) else []:
        if isinstance(task, dict):
            yield task
            for key in ("block", "rescue", "always"):
                yield from _tasks(task.get(key))


def _role_name(args) -> str | None:
    name = args if isinstance(args, str) else (args or {}).get("name") or (args or {}).get("role")
    return name if isinstance(name, str) and "{{" not in name else None


def _roles_of_tasks(tasks) -> set[str]:
    return {n for t in _tasks(tasks) for a in ROLE_ACTIONS & set(t) if (n := _role_name(t[a]))}


def _playbook_closure(path: Path, seen: set[Path], roles: set[str]) -> None:
    """The playbooks a playbook imports (into ``seen``) and the roles their plays name (into ``roles``)."""
    path = path.resolve()
    if path in seen or not path.is_file():
        return
    seen.add(path)
    for play in _load(path) if isinstance(_load(path), list) else []:
        if not isinstance(play, dict):
            continue
        for action in PLAYBOOK_ACTIONS & set(play):
            if isinstance(play[action], str) and "{{" not in play[action]:
                _playbook_closure(path.parent / play[action], seen, roles)
        roles.update(n for r in play.get("roles") or [] if (n := _role_name(r)))
        for key in TASK_LISTS:
            roles |= _roles_of_tasks(play.get(key))


def _role_closure(roles: set[str], root: Path) -> set[str]:
    """The roles with their meta dependencies and the roles their task files include."""
    todo, out = list(roles), set()
    while todo:
        role = todo.pop()
        base = root / "roles" / role
        if role in out or not base.is_dir():
            continue
        out.add(role)
        deps = (_load(base / "meta" / "main.yml") or {}).get("dependencies") or []
        todo += [n for d in deps if (n := _role_name(d))]
        for f in sorted((base / "tasks").glob("*.yml")) + sorted((base / "handlers").glob("*.yml")):
            todo += sorted(_roles_of_tasks(_load(f)))
    return out


@functools.cache
def scenario_uses(scenario: str, root: Path = ROOT) -> tuple[frozenset[str], frozenset[str]]:
    """(roles, playbook paths relative to root) that a scenario runs."""
    sdir = root / "molecule" / scenario
    seen: set[Path] = set()
    roles: set[str] = set()
    for f in sorted(sdir.glob("*.yml")):
        if f.name != "molecule.yml":
            _playbook_closure(f, seen, roles)
    books = {p.relative_to(root.resolve()).as_posix() for p in seen if root.resolve() in p.parents}
    return frozenset(_role_closure(roles, root)), frozenset(b for b in books if not b.startswith("molecule/"))


def _scenario_text(scenario: str, roles: frozenset[str], books: frozenset[str], root: Path) -> str:
    files = [f for f in (root / "molecule" / scenario).rglob("*") if f.is_file()]
    files += [f for r in roles for f in (root / "roles" / r).rglob("*") if f.is_file()]
    files += [root / b for b in books]
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def _named_key(path: str) -> str:
    """The name a scenario's files use for a shared file: its file name, or a fixture's top name."""
    parts = path.split("/")
    if path.startswith("tests/fixtures/"):
        return Path(parts[2]).stem
    return parts[-1]


def affected(paths: Iterable[str], scenarios: list[str], root: Path = ROOT) -> list[str]:
    """The scenarios among ``scenarios`` a change of ``paths`` may break, in their order."""
    uses = {s: scenario_uses(s, root) for s in scenarios}
    texts: dict[str, str] = {}
    hit: set[str] = set()
    for path in paths:
        parts = path.split("/")
        if path.endswith(".md") or path.startswith(NONE_PREFIXES):
            continue
        if parts[0] == "molecule" and len(parts) > 2 and parts[1] != "_shared":
            hit |= {parts[1]} & set(scenarios)
        elif parts[0] == "roles" and len(parts) > 2:
            hit |= {s for s, (roles, _) in uses.items() if parts[1] in roles}
        elif (parts[0] == "playbooks" and len(parts) == 2) or path == "site.yml":
            hit |= {s for s, (_, books) in uses.items() if path in books}
        elif path.startswith(NAMED_PREFIXES):
            for s in scenarios:
                if s not in texts:
                    texts[s] = _scenario_text(s, *uses[s], root)
            named = {s for s in scenarios if _named_key(path) in texts[s]}
            hit |= named or set(scenarios)
        else:
            hit |= set(scenarios)
    return [s for s in scenarios if s in hit]


def changed_paths(base: str, root: Path = ROOT) -> list[str]:
    def git(*args: str) -> list[str]:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            err = done.stderr.strip().splitlines()[-1:] or [f"git {' '.join(args)} failed"]
            raise (UsageError if args[0] == "merge-base" else RuntimeError)(err[0])
        return [line for line in done.stdout.splitlines() if line]

    merge_base = git("merge-base", "HEAD", base)[0]
    return git("diff", "--name-only", "--no-renames", merge_base) + git("ls-files", "--others",
                                                                        "--exclude-standard")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="affected.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD",
                    help="compare with the merge base of HEAD and BASE (default HEAD)")
    ap.add_argument("--paths", nargs="+", help="changed paths (instead of asking git)")
    ap.add_argument("scenarios", nargs="+", help="the scenarios to choose from (molecule/<scenario>/)")
    a = ap.parse_args(argv)
    unknown = [s for s in a.scenarios if not (ROOT / "molecule" / s / "molecule.yml").is_file()]
    try:
        if unknown:
            raise UsageError(f"no scenario {', '.join(unknown)} (molecule/<scenario>/molecule.yml): "
                             f"name scenarios of molecule/")
        paths = a.paths if a.paths is not None else changed_paths(a.base)
    except UsageError as exc:
        print(f"affected.py: {exc} (BASE must be a commit git knows, e.g. HEAD or origin/main)"
              if not unknown else f"affected.py: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"affected.py: cannot list the changed files: {exc}", file=sys.stderr)
        return 1
    print(" ".join(affected(paths, a.scenarios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
