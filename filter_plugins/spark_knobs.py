"""Misspelt variables and tags: the names the toolkit knows, derived from the project's own files.

Pure Python (PyYAML, which Ansible itself needs); Ansible only needs the ``FilterModule`` at the bottom.

The one list of knobs is read from the project, never copied by hand:

- every option of every entry point in ``roles/*/meta/argument_specs.yml``;
- every top-level name in ``group_vars/all/*.yml``;
- role-internal names a play may hold as host variables: ``roles/*/defaults|vars/main.yml``, the
  ``register:`` and ``set_fact`` names and the ``vars:`` of tasks and plays in ``roles/``, ``playbooks/``
  and ``site.yml``.

The toolkit's namespaces are the first words of the knobs from the argument specs and group_vars
(``spark_``, ``vllm_``, ``spec_``, ``bench_``, ...). A host variable in one of them that is not a
known name is refused with the closest known one. Owners' own variables in those namespaces pass
when ``spark_knobs_allowed`` names them (names or shell patterns such as ``spark_site_*``).

The stage tags are the play tags of ``playbooks/*.yml`` (in site.yml's order); the known tags are
every tag used in ``site.yml``, ``playbooks/`` and ``roles/`` plus Ansible's own special tags and
molecule's ``molecule-notest``/``notest``/``molecule-idempotence-notest`` in --skip-tags (it skips
them in its runs).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

PROJECT = Path(__file__).resolve().parents[1]
SPECIAL_TAGS = ("all", "always", "never", "tagged", "untagged")
# molecule runs its playbooks with --skip-tags molecule-notest,notest,molecule-idempotence-notest (its
# convention for tasks to leave out): tags of the test tool, known in --skip-tags only
TOOL_SKIP_TAGS = re.compile(r"notest|molecule-[a-z-]*notest")
ALLOW_VAR = "spark_knobs_allowed"
_SET_FACT = ("set_fact", "ansible.builtin.set_fact", "ansible.legacy.set_fact")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads Ansible's !unsafe / !vault tags as plain values."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _load(path: Path):
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except (OSError, yaml.YAMLError):
        return None


def _keys(data) -> set[str]:
    return {k for k in data if isinstance(k, str)} if isinstance(data, Mapping) else set()


def _walk(node, names: set[str], tags: list[str]) -> None:
    """Collect register/set_fact/vars names and tags from a parsed playbook or task file."""
    if isinstance(node, list):
        for item in node:
            _walk(item, names, tags)
        return
    if not isinstance(node, Mapping):
        return
    reg = node.get("register")
    if isinstance(reg, str):
        names.add(reg)
    for key in _SET_FACT:
        names |= _keys(node.get(key)) - {"cacheable"}
    names |= _keys(node.get("vars"))
    node_tags = node.get("tags")
    if isinstance(node_tags, str):
        node_tags = [t.strip() for t in node_tags.split(",")]
    if isinstance(node_tags, list):
        tags.extend(t for t in node_tags if isinstance(t, str) and t not in tags)
    for value in node.values():
        if isinstance(value, list | Mapping):
            _walk(value, names, tags)


@functools.lru_cache(maxsize=8)
def _project(root: str) -> dict:
    base = Path(root)
    knobs: set[str] = set()
    for spec in sorted(base.glob("roles/*/meta/argument_specs.yml")):
        for entry in ((_load(spec) or {}).get("argument_specs") or {}).values():
            knobs |= _keys((entry or {}).get("options"))
    for gv in sorted(base.glob("group_vars/all/*.yml")):
        knobs |= _keys(_load(gv))
    internal: set[str] = set()
    for f in sorted(base.glob("roles/*/defaults/main.yml")) + sorted(base.glob("roles/*/vars/main.yml")):
        internal |= _keys(_load(f))
    tags: list[str] = []
    stage_tags: list[str] = []
    site = _load(base / "site.yml") or []
    order = [p.get("ansible.builtin.import_playbook") or p.get("import_playbook") or ""
             for p in site if isinstance(p, Mapping)]
    playbooks = [base / o for o in order if o] + sorted(base.glob("playbooks/*.yml"))
    for pb in dict.fromkeys(playbooks):
        plays = _load(pb) or []
        for play in plays if isinstance(plays, list) else []:
            play_tags = play.get("tags") if isinstance(play, Mapping) else None
            for t in [play_tags] if isinstance(play_tags, str) else play_tags or []:
                if t not in SPECIAL_TAGS and t not in stage_tags:
                    stage_tags.append(t)
        _walk(plays, internal, tags)
    _walk(site, internal, tags)
    for f in sorted(base.glob("roles/*/tasks/*.yml")) + sorted(base.glob("roles/*/handlers/*.yml")):
        _walk(_load(f), internal, tags)
    prefixes = sorted({k.split("_", 1)[0] + "_" for k in knobs if "_" in k.strip("_")
                       and not k.startswith("_")})
    return {"knobs": frozenset(knobs), "internal": frozenset(internal), "prefixes": tuple(prefixes),
            "tags": tuple(dict.fromkeys([*stage_tags, *tags, *SPECIAL_TAGS])),
            "stage_tags": tuple(stage_tags)}


def spark_known_knobs(root: str | None = None) -> dict:
    """{'knobs': sorted user knobs, 'internal': sorted role-internal names, 'prefixes': namespaces,
    'tags': every known tag, 'stage_tags': the stages' tags}."""
    data = _project(str(root or PROJECT))
    return {k: sorted(v) if isinstance(v, frozenset) else list(v) for k, v in data.items()}


def _allowed(value) -> tuple[list[str], list[str]]:
    """(patterns, errors) of spark_knobs_allowed."""
    if value is None or value == "":
        return [], []
    if isinstance(value, str) or not isinstance(value, Iterable) or isinstance(value, Mapping) \
            or not all(isinstance(v, str) and v for v in value):
        return [], [f"{ALLOW_VAR} must be a list of variable names or patterns, e.g. "
                    f"-e '{{\"{ALLOW_VAR}\": [\"spark_site_label\"]}}', got {value!r}"]
    return list(value), []


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def spark_unknown_knobs(variables: Mapping, root: str | None = None) -> list[str]:
    """One message per variable in the toolkit's namespaces that no role, group_vars file or play
    defines, naming the closest known name and the opt-out."""
    data = _project(str(root or PROJECT))
    names = [k for k in variables if isinstance(k, str)] if isinstance(variables, Mapping) else []
    allowed, errors = _allowed(variables.get(ALLOW_VAR) if isinstance(variables, Mapping) else None)
    known = data["knobs"] | data["internal"]
    public = [k for k in known if not k.startswith("_")]
    for name in sorted(names):
        if not name.startswith(data["prefixes"]) or name in known:
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in allowed):
            continue
        errors.append(f"{name} is not a variable of this toolkit{_suggest(name, public)};"
                      f" if it is your own, list it in {ALLOW_VAR}")
    return errors


def spark_tag_errors(run_tags, skip_tags=(), root: str | None = None) -> list[str]:
    """One message per --tags/--skip-tags value no play, role or task uses (Ansible would run nothing
    for it and report success), naming the stage tags."""
    data = _project(str(root or PROJECT))
    errors = []
    for flag, given in (("--tags", run_tags), ("--skip-tags", skip_tags)):
        for tag in [given] if isinstance(given, str) else list(given or []):
            if tag not in data["tags"] and not (flag == "--skip-tags" and TOOL_SKIP_TAGS.fullmatch(tag)):
                errors.append(f"{flag} {tag}: no play or task has this tag{_suggest(tag, data['tags'])}")
    if errors:
        errors.append("the stage tags are " + ", ".join(data["stage_tags"]))
    return errors


class FilterModule:
    """Ansible filters: spark_unknown_knobs, spark_tag_errors, spark_known_knobs."""

    def filters(self):
        return {
            "spark_unknown_knobs": spark_unknown_knobs,
            "spark_tag_errors": spark_tag_errors,
            "spark_known_knobs": spark_known_knobs,
        }
