"""Every variable's default is defined once (issue 32): a second definition fails, naming both places.

Where a default can be written:
- a top-level name in group_vars/ (any file), roles/*/defaults/main.yml or roles/*/vars/main.yml;
- a Jinja fallback with a literal value, ``NAME | default('value')``, in those files (a fallback to
  none/omit/''/[]/{} says "absent", not a value, and is not counted);
- an argument spec's ``default:`` equal to the value Ansible takes (Ansible never applies it: it is a copy;
  scripts/role_docs.py removes it);
- Python in filter_plugins/ and scripts/*.py: a dict literal that maps a variable's name to a constant (a
  table of defaults), or ``.get("name", constant)`` with a constant fallback.

A name with two of these is reported with both places. ALLOWED lists the only exceptions: two definitions
that are genuinely different things, each with the reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

# name -> why its second definition is a different thing (not a repeated default)
ALLOWED: dict[str, str] = {
    "spark_master_port": (
        "default(29501, true) in roles/spark_link/vars names the port vLLM takes when the knob is null "
        "(no --master-port; vLLM's config/parallel.py default), for the firewall: the meaning of null, not a "
        "second default of the knob (the filter keeps None)"
    ),
}

_FALLBACK = re.compile(r"(?<![.\w\]])([A-Za-z_][A-Za-z0-9_]*)\s*\|\s*default\(\s*([^,)]*)")
_ABSENT = {"none", "None", "omit", "''", '""', "[]", "{}", ""}
_LITERAL = re.compile(r"""(['"]).*\1|-?[0-9][0-9_.]*|true|false|True|False""")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads Ansible's !unsafe / !vault tags as plain values."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _load(path: Path):
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 (a SafeLoader)


def var_files(root: Path) -> list[Path]:
    return (sorted((root / "group_vars").rglob("*.yml")) + sorted(root.glob("roles/*/defaults/main.yml"))
            + sorted(root.glob("roles/*/vars/main.yml")))


def definitions(root: Path) -> dict[str, list[str]]:
    """name -> every place that gives it a default (``path`` or ``path:line what``)."""
    found: dict[str, list[str]] = {}
    values: dict[str, object] = {}
    for f in var_files(root):
        rel = f.relative_to(root)
        for name, value in (_load(f) or {}).items():
            found.setdefault(name, []).append(str(rel))
            values.setdefault(name, value)
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            for m in _FALLBACK.finditer(line):
                name, literal = m.group(1), m.group(2).strip()
                if literal not in _ABSENT and _LITERAL.fullmatch(literal):
                    found.setdefault(name, []).append(f"{rel}:{i} {name} | default({literal})")
    for spec in sorted(root.glob("roles/*/meta/argument_specs.yml")):
        for entry in (_load(spec).get("argument_specs") or {}).values():
            for name, opt in ((entry or {}).get("options") or {}).items():
                if "default" in opt and name in values and type(opt["default"]) is type(values[name]) \
                        and opt["default"] == values[name]:
                    found[name].append(f"{spec.relative_to(root)} {name}.default (run scripts/role_docs.py)")
    names = set(found)
    for py in sorted(root.glob("filter_plugins/*.py")) + sorted(root.glob("scripts/*.py")):
        rel = py.relative_to(root)
        for node in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value in names \
                            and isinstance(value, ast.Constant):
                        found[key.value].append(f"{rel}:{key.lineno} {{{key.value!r}: {value.value!r}}}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "get" and len(node.args) == 2
                  and isinstance(node.args[0], ast.Constant)
                  and node.args[0].value in names and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value is not None):
                found[node.args[0].value].append(f"{rel}:{node.lineno} .get({node.args[0].value!r}, "
                                                 f"{node.args[1].value!r})")
    return found


def twice(root: Path) -> dict[str, list[str]]:
    return {name: places for name, places in definitions(root).items() if len(places) > 1}


def test_every_default_is_defined_once() -> None:
    found = definitions(ROOT)
    assert len(found) > 300, len(found)  # the scan reads the project
    assert any("group_vars/all/main.yml" in p for p in found["spec_method"])
    dup = {name: places for name, places in twice(ROOT).items() if name not in ALLOWED}
    assert not dup, "defined more than once (keep one, derive the rest):\n" + "\n".join(
        f"  {name}: {' AND '.join(places)}" for name, places in sorted(dup.items()))


def test_every_allowed_exception_is_still_needed() -> None:
    dup = twice(ROOT)
    for name, reason in ALLOWED.items():
        assert reason.strip()
        assert name in dup, f"ALLOWED[{name!r}] is no longer defined twice: remove the exception"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(("files", "name", "places"), [
    pytest.param({"group_vars/all/a.yml": "x_port: 1\n", "roles/r/defaults/main.yml": "x_port: 1\n"},
                 "x_port", ["group_vars/all/a.yml", "roles/r/defaults/main.yml"], id="group_vars-and-role"),
    pytest.param({"roles/a/defaults/main.yml": "a_file: \"{{ x_file | default('/etc/x') }}\"\n",
                  "roles/b/defaults/main.yml": "b_file: \"{{ x_file | default('/etc/x') }}\"\n"},
                 "x_file", ["roles/a/defaults/main.yml:1 x_file | default('/etc/x')",
                            "roles/b/defaults/main.yml:1 x_file | default('/etc/x')"], id="two-fallbacks"),
    pytest.param({"group_vars/all/a.yml": "x_n: 4\n", "filter_plugins/f.py": "D = {'x_n': 4}\n"},
                 "x_n", ["group_vars/all/a.yml", "filter_plugins/f.py:1 {'x_n': 4}"], id="filter-table"),
    pytest.param({"roles/r/defaults/main.yml": "x_c: '1'\n", "scripts/s.py": "v = s.get('x_c', '1')\n"},
                 "x_c", ["roles/r/defaults/main.yml", "scripts/s.py:1 .get('x_c', '1')"], id="script-get"),
    pytest.param({"roles/r/defaults/main.yml": "x_c: '1'\n",
                  "roles/r/meta/argument_specs.yml": "argument_specs:\n  main:\n    options:\n      x_c:\n"
                                                     "        type: str\n        default: '1'\n"},
                 "x_c", ["roles/r/defaults/main.yml",
                         "roles/r/meta/argument_specs.yml x_c.default (run scripts/role_docs.py)"],
                 id="spec"),
])
def test_a_second_definition_is_found_with_both_places(tmp_path: Path, files, name, places) -> None:
    assert twice(_tree(tmp_path, files)) == {name: places}


def test_absent_fallbacks_and_described_spec_defaults_are_not_definitions(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "group_vars/all/a.yml": "x_list: []\nx_dir: /d\n",
        "roles/r/defaults/main.yml": "r_list: \"{{ x_list | default([]) }}\"\nr_dir: \"{{ x_dir }}/sub\"\n",
        "roles/r/meta/argument_specs.yml": "argument_specs:\n  main:\n    options:\n      r_dir:\n"
                                           "        type: path\n        default: x_dir/sub\n",
        "filter_plugins/f.py": "v = s.get('x_dir')\n",
    })
    assert twice(root) == {}


# --- Issue 48: a fact more than one role reads lives once in group_vars/all, read by its name ---------
# No role reads another role's files (a lookup of its defaults/main.yml), and nothing gives a group_vars/all
# knob a second default with ``| default(...)``: the knob is always defined (molecule links the project's
# group_vars).

# group_vars knob -> why its ``| default(...)`` stays (none today: no knob's fallback is needed).
FALLBACK_ALLOWED: dict[str, str] = {}

_ROLE_DIRS = ("defaults", "vars", "tasks", "handlers", "meta", "templates", "files")
# role_path ~ '/../other/...' (one level up: another role; '/../../' is the project's own templates/)
_ROLE_PATH_UP = re.compile(r"role_path\W[^\n]*?(?<!\.)/\.\./(?!\.\./)(?P<role>[A-Za-z_]\w*)/")
_ROLES_DIR = re.compile(r"(?<![\w.])roles/(?P<role>[A-Za-z_]\w*)/(?:" + "|".join(_ROLE_DIRS) + r")/")


def _code(path: Path) -> str:
    """The file's text with its YAML comment lines and Jinja comments blanked (line numbers kept)."""
    text = re.sub(r"\{#.*?#\}", lambda m: "\n" * m[0].count("\n"), path.read_text(encoding="utf-8"),
                  flags=re.DOTALL)
    return "\n".join("" if line.lstrip().startswith("#") else line for line in text.splitlines())


def _scanned(root: Path) -> list[Path]:
    """The files Ansible reads: every role's YAML and templates, the playbooks, the top-level templates."""
    files = [f for d in _ROLE_DIRS for f in sorted(root.glob(f"roles/*/{d}/**/*"))
             if f.suffix in (".yml", ".j2")]
    return files + sorted(root.glob("playbooks/**/*.yml")) + sorted(root.glob("templates/**/*.j2"))


def cross_role_reads(root: Path) -> list[str]:
    """``path:line -> role`` for every file that names another role's files."""
    out = []
    for f in _scanned(root):
        rel = f.relative_to(root)
        own = rel.parts[1] if rel.parts[0] == "roles" else None
        for i, line in enumerate(_code(f).splitlines(), 1):
            for m in list(_ROLE_PATH_UP.finditer(line)) + list(_ROLES_DIR.finditer(line)):
                if m["role"] != own:
                    out.append(f"{rel}:{i} -> {m['role']}")
    return out


def group_vars_keys(root: Path) -> set[str]:
    return {k for f in sorted((root / "group_vars" / "all").glob("*.yml")) for k in (_load(f) or {})}


def group_vars_fallbacks(root: Path) -> list[str]:
    """``path:line name`` of every ``NAME | default(`` (or ``NAME.key | default(``) of a group_vars key.
    An entry looked up by a variable (``NAME[spec_method] | default(0)``: a method without one) is not the
    knob's default and is not counted."""
    keys = group_vars_keys(root)
    if not keys:
        return []
    names = "|".join(sorted(map(re.escape, keys), key=len, reverse=True))
    rx = re.compile(r"(?<![.\w\]])(?P<name>" + names + r")(?![\w\[])(?:\.\w+)*\s*\|\s*default\s*\(")
    out = []
    for f in _scanned(root):
        text = _code(f)
        for m in rx.finditer(text):
            out.append(f"{f.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1} {m['name']}")
    return out


def test_no_role_reads_another_roles_files() -> None:
    assert len(_scanned(ROOT)) > 100  # the scan reads the project
    found = cross_role_reads(ROOT)
    assert not found, ("a role reads another role's files; move the fact to group_vars/all (shared.yml) "
                       "and read it by its name:\n  " + "\n  ".join(found))


def test_no_group_vars_knob_gets_a_second_default() -> None:
    keys = group_vars_keys(ROOT)
    assert {"spec_method", "serve_unit_prefix", "spark_cluster_backend"} <= keys
    found = [p for p in group_vars_fallbacks(ROOT) if p.rsplit(" ", 1)[1] not in FALLBACK_ALLOWED]
    assert not found, ("a group_vars/all knob with a second default (group_vars always defines it: drop the "
                       "| default(...)):\n  " + "\n  ".join(found))


def test_every_allowed_fallback_is_still_used() -> None:
    used = {p.rsplit(" ", 1)[1] for p in group_vars_fallbacks(ROOT)}
    for name, reason in FALLBACK_ALLOWED.items():
        assert reason.strip() and name in used, f"FALLBACK_ALLOWED[{name!r}] is unused: remove it"


@pytest.mark.parametrize(("text", "found"), [
    pytest.param("x_dir: \"{{ (lookup('file', role_path ~ '/../b/defaults/main.yml') | from_yaml).d }}\"\n",
                 ["roles/a/defaults/main.yml:1 -> b"], id="lookup-of-another-role"),
    pytest.param("x_tpl: \"{{ playbook_dir }}/../roles/b/templates/t.j2\"\n",
                 ["roles/a/defaults/main.yml:1 -> b"], id="roles-path"),
    pytest.param("x_tpl: \"{{ role_path }}/../../templates/t.j2\"\n", [], id="project-templates"),
    pytest.param("x_own: \"{{ role_path }}/../a/files/f\"\n", [], id="own-role"),
    pytest.param("# role_path ~ '/../b/defaults/main.yml' (a comment)\nx: 1\n", [], id="comment"),
    pytest.param("x: 1\n{# roles/b/files/f (a Jinja comment\n  over lines) #}\ny: roles/b/files/f\n",
                 ["roles/a/defaults/main.yml:4 -> b"], id="jinja-comment"),
])
def test_a_cross_role_read_is_found(tmp_path: Path, text: str, found: list[str]) -> None:
    root = _tree(tmp_path, {"roles/a/defaults/main.yml": text, "roles/b/defaults/main.yml": "d: /x\n"})
    assert cross_role_reads(root) == found


@pytest.mark.parametrize(("text", "found"), [
    pytest.param("when: x_port | default(1) | int > 0\n", ["roles/r/tasks/main.yml:1 x_port"], id="literal"),
    pytest.param("a: \"{{ x_ports.gcs|default(6379) }}\"\n", ["roles/r/tasks/main.yml:1 x_ports"], id="item"),
    pytest.param("a: >-\n  {{ x_port\n     | default(none) }}\n", ["roles/r/tasks/main.yml:2 x_port"],
                 id="multi-line"),
    pytest.param("a: \"{{ x_port_other | default(1) }}\"\n", [], id="longer-name"),
    pytest.param("a: \"{{ x_ports[spec_method] | default(0) }}\"\n", [], id="entry-by-variable"),
    pytest.param("a: \"{{ hv.x_port | default(1) }}\"\n", [], id="another-hosts-attribute"),
    pytest.param("a: \"{{ x_port }}\"\n# x_port | default(1)\n", [], id="no-fallback"),
])
def test_a_group_vars_fallback_is_found(tmp_path: Path, text: str, found: list[str]) -> None:
    root = _tree(tmp_path, {"group_vars/all/a.yml": "x_port: 1\nx_ports: {gcs: 6379}\n",
                            "roles/r/tasks/main.yml": text})
    assert group_vars_fallbacks(root) == found
