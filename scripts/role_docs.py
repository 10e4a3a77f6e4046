#!/usr/bin/env python3
"""Write each role's variable table into its README from meta/argument_specs.yml, and the method
choices of the argument specs from the method catalogue (controller tool).

The table sits between two marker lines in roles/<role>/README.md; everything else in the README is
prose written by hand. A ``choices:`` line of an argument spec that ends with the comment
``# generated from spark_method_catalogue`` is written from the catalogue's methods
(group_vars/all/methods.yml): Ansible reads argument specs as static data (no templating), so the one
list of methods reaches them by this generator, and the specs still refuse a bad method before any
task runs. A default lives once, in the role's defaults/main.yml (or group_vars/all/ for a shared
knob), where Ansible takes it from: Ansible never applies an argument spec's ``default``, so one that
repeats that value is a second copy, and this tool removes it (the table shows the value from
defaults/main.yml). A spec ``default`` stays only where it says in words what a templated default
works out to. ``--check`` changes nothing and exits 1 naming the files that are stale (the unit tests
run it), so a knob added to the argument specs cannot go undocumented and a method added to the
catalogue cannot be missing from a role's choices.

It also writes the ``knobs:`` list of every stage in playbooks/vars/stages.yml (the inputs the stage gate
fingerprints; the other keys of a stage stay written by hand): the options and defaults of every role the
stage runs whole, plus every known knob (an argument-spec option, a role default or a group_vars/all key)
or serving setting (``hostvars | spark_settings``: filter_plugins/spark_methods.py SETTING_DEFAULTS) that a
Jinja expression of the stage's files names (not inside a string literal or a Jinja comment), plus the names
kept by hand in ``EXTRA_KNOBS`` (each with its reason; none today), less the stage's ``force`` and ``facts``,
the gate's own knob and what the stage sets itself (set_fact). A knob added to a role or read by a new
template line is then an input of its stage without anyone listing it.

    .venv/bin/python scripts/role_docs.py            # rewrite the tables
    .venv/bin/python scripts/role_docs.py --check    # exit 1 when a table or a stage's knobs differ
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml
from sparkllm.cli import doc_parser

ROOT = Path(__file__).resolve().parents[1]
BEGIN = (
    "<!-- BEGIN variables: generated from meta/argument_specs.yml by scripts/role_docs.py; do not edit -->"
)
END = "<!-- END variables -->"
MAX_DEFAULT = 60  # longer defaults are shown as "see defaults/main.yml"
CATALOGUE = ROOT / "group_vars" / "all" / "methods.yml"
METHODS_MARK = "# generated from spark_method_catalogue"
_CHOICES_RE = re.compile(
    r"^(?P<indent>\s*)choices: \[[^\]]*\](?P<mark>\s+" + re.escape(METHODS_MARK) + r".*)$", re.MULTILINE
)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(name: str, opt: dict, defaults: dict, shared: dict) -> str:
    if opt.get("required"):
        return "required"
    if "default" not in opt and name not in defaults and name not in shared:
        return ""
    value = opt["default"] if "default" in opt else defaults.get(name, shared.get(name))
    if isinstance(value, str) and "spark_model_entry" in value and "default" not in opt:
        return "the model's (`group_vars/all/models.yml`)"
    shown = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    if len(shown) > MAX_DEFAULT:
        return "see `defaults/main.yml`" if name in defaults or "default" in opt else "see `group_vars/all/`"
    return f"`{_cell(shown)}`" if shown != "" else '`""`'


def group_vars(root: Path = ROOT) -> dict:
    out: dict = {}
    for f in sorted((root / "group_vars" / "all").glob("*.yml")):
        out.update(yaml.safe_load(f.read_text()) or {})
    return out


def own_defaults(role: Path) -> dict:
    defaults_file = role / "defaults" / "main.yml"
    return (yaml.safe_load(defaults_file.read_text()) or {}) if defaults_file.is_file() else {}


def role_defaults(role: Path) -> dict:
    """The defaults a role's variables take: its defaults/main.yml over group_vars/all/."""
    return {**group_vars(role.parent.parent), **own_defaults(role)}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def without_repeated_defaults(spec_text: str, defaults: dict) -> str:
    """The argument specs without every option's ``default:`` that repeats the value Ansible takes."""
    doc = yaml.safe_load(spec_text)["argument_specs"]
    repeated = {name for entry in doc.values() for name, opt in (entry.get("options") or {}).items()
                if "default" in opt and name in defaults and _same(opt["default"], defaults[name])}
    out: list[str] = []
    option = None
    dropping = False
    for line in spec_text.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        if dropping and body and (indent > 8 or (indent == 8 and body.startswith("- "))):
            continue
        dropping = False
        if indent == 6 and body.endswith(":") and not body.startswith("#"):
            option = body[:-1]
        elif indent == 8 and body.startswith("default:") and option in repeated:
            dropping = True
            continue
        out.append(line)
    return "".join(out)


def table(role: Path) -> str:
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    defaults, shared = own_defaults(role), group_vars(role.parent.parent)
    lines = [BEGIN, "", "| variable | type | default | description |", "|---|---|---|---|"]
    for entry in specs.values():
        for name, opt in (entry.get("options") or {}).items():
            typ = opt.get("type", "str")
            if typ == "list" and "elements" in opt:
                typ = f"list of {opt['elements']}"
            desc = opt.get("description", "")
            desc = " ".join(desc) if isinstance(desc, list) else desc
            if opt.get("choices"):
                desc = f"{desc} One of: {', '.join(f'`{c}`' for c in opt['choices'])}."
            lines.append(f"| `{name}` | {typ} | {_default(name, opt, defaults, shared)} | {_cell(desc)} |")
    lines += ["", END]
    return "\n".join(lines)


def catalogue_methods(path: Path = CATALOGUE) -> list[str]:
    return list(yaml.safe_load(path.read_text())["spark_method_catalogue"])


def with_method_choices(spec_text: str, methods: list[str]) -> str:
    """The argument specs with every marked ``choices:`` line set to the catalogue's methods."""
    return _CHOICES_RE.sub(lambda m: f"{m['indent']}choices: [{', '.join(methods)}]{m['mark']}", spec_text)


def updated(readme: str, block: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError("no variable-table markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


# --- the stage inputs: playbooks/vars/stages.yml's knobs -----------------------------------------

STAGES = ROOT / "playbooks" / "vars" / "stages.yml"
KNOBS_MARK = "The knobs: lists are generated by scripts/role_docs.py; do not edit them"
# Knobs a stage reads that no argument spec, role default or group_vars/all file declares, by hand:
# stage -> {name: why}. None today: every knob a stage reads is declared by one of those or by the
# settings filter.
EXTRA_KNOBS: dict[str, dict[str, str]] = {}
# The gate's own knob (group_vars/all/stages.yml): it asks for the work, it is not an input (every stage
# has it; tests/unit/test_stage_inputs.py imports it).
GATE_KNOBS = {"spark_stage_force"}
SET_FACT = {"set_fact", "ansible.builtin.set_fact"}
_JINJA_RE = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.DOTALL)
_JINJA_COMMENT_RE = re.compile(r"\{#.*?#\}", re.DOTALL)
# a variable, not an attribute (after a dot) nor part of a longer name
_VAR_RE = re.compile(r"(?<![.\w])[A-Za-z_]\w*")
_LITERAL_RE = re.compile(r"'[^']*'|\"[^\"]*\"")
# keys whose string is a bare Jinja expression (Ansible templates them without braces)
BARE_KEYS = {"when", "that", "failed_when", "changed_when", "until"}


def _expressions(text: str, bare: bool = False) -> list[str]:
    """The Jinja expressions of a string: all of it when bare, else what its {{ }} and {% %} hold."""
    text = _JINJA_COMMENT_RE.sub("", text)
    return [text] if bare else [a or b for a, b in _JINJA_RE.findall(text)]


def yaml_strings(node, key=None):
    """(text, bare?) of every string value in a parsed YAML document (tests/unit/test_stage_inputs.py
    reads YAML with it too)."""
    if isinstance(node, str):
        yield node, key in BARE_KEYS
    elif isinstance(node, list):
        for v in node:
            yield from yaml_strings(v, key)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from yaml_strings(v, k if isinstance(k, str) else None)


def _names(texts) -> set[str]:
    """The variable names of Jinja expressions (not the words of their string literals)."""
    return {m for t in texts for m in _VAR_RE.findall(_LITERAL_RE.sub("''", t))}


def _yaml_names(doc) -> set[str]:
    return _names(e for text, bare in yaml_strings(doc) for e in _expressions(text, bare))


def _set_facts(node) -> set[str]:
    """The names a task file sets at run time (set_fact): what a stage produces, not an input of it."""
    if isinstance(node, list):
        return {n for v in node for n in _set_facts(v)}
    if not isinstance(node, dict):
        return set()
    out = {k for a in SET_FACT & set(node) for k in (node[a] or {}) if k != "cacheable"}
    return out.union(*(_set_facts(v) for v in node.values()))


def _load(path: Path):
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None


def _settings_names() -> set[str]:
    """The host variables ``hostvars | spark_settings`` picks (filter_plugins/spark_methods.py)."""
    plugins = str(ROOT / "filter_plugins")
    if plugins not in sys.path:
        sys.path.append(plugins)
    import spark_methods

    return set(spark_methods.SETTING_DEFAULTS)


def known_knobs(root: Path = ROOT) -> set[str]:
    """Every value a user sets: main argument-spec options, role defaults (not ``_*``), group_vars keys.
    (The options of another entry point that no default backs are arguments a play passes.)"""
    out = set(group_vars(root))
    for role in sorted((root / "roles").iterdir()):
        out |= {k for k in own_defaults(role) if not k.startswith("_")}
        specs = (_load(role / "meta" / "argument_specs.yml") or {}).get("argument_specs") or {}
        out |= set((specs.get("main") or {}).get("options") or {})
    return out


def stage_knobs(stage: str, root: Path = ROOT) -> list[str]:
    """The knobs of one stage, derived (module docstring), sorted."""
    from sparkllm.stage import gate as st

    decl = st.declarations(root)[stage]
    known = known_knobs(root)
    knobs: set[str] = set()
    read: set[str] = set()
    produced: set[str] = set()
    partial_defaults: dict[str, set[str]] = {}  # default of a partly run role -> what its value reads
    files = [root / "playbooks" / p for p in decl.playbooks]
    read |= _yaml_names(decl.outputs)
    for role, tasks in st.stage_roles(stage, root).items():
        base = root / "roles" / role
        defaults = _load(base / "defaults" / "main.yml") or {}
        files.append(base / "vars" / "main.yml")
        if tasks is None:
            knobs |= {k for k in defaults if not k.startswith("_")}
            specs = (_load(base / "meta" / "argument_specs.yml") or {}).get("argument_specs") or {}
            knobs |= {o for e in specs.values() for o in (e.get("options") or {}) if o in known}
            files += [base / "defaults" / "main.yml"]
            files += [f for d in ("tasks", "handlers") for f in sorted((base / d).glob("*.yml"))]
            files += [f for d in ("templates", "files") for f in sorted((base / d).rglob("*.j2"))]
        else:
            for name, value in defaults.items():
                partial_defaults[name] = _yaml_names(value) | {name}
            files += [base / "tasks" / t for t in sorted(tasks)]
    files = [f for f in files if f.is_file()]
    text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    files += [t for t in sorted((root / "templates").rglob("*.j2")) if t.name in text]
    for f in files:
        if f.suffix == ".j2":
            read |= _names(_expressions(f.read_text(encoding="utf-8")))
        else:
            doc = _load(f)
            read |= _yaml_names(doc)
            produced |= _set_facts(doc)
            if "spark_settings" in f.read_text(encoding="utf-8"):
                read |= _settings_names()
    todo = [n for n in read if n in partial_defaults]
    while todo:
        for name in partial_defaults.pop(todo.pop(), set()) - read:
            read.add(name)
            todo += [name] if name in partial_defaults else []
    # a serving setting (hostvars | spark_settings) a user may set, defaulted in the filter itself
    knobs |= read & (known | _settings_names())
    knobs |= set(EXTRA_KNOBS.get(stage, {}))
    return sorted(knobs - produced - GATE_KNOBS - set(decl.force) - set(decl.facts))


def _knobs_block(names: list[str], indent: str, width: int = 112) -> str:
    lines, line = [], indent + "  "
    for i, name in enumerate(names):
        item = name + ("," if i < len(names) - 1 else "]")
        if len(line) + len(item) + 1 > width and line.strip():
            lines.append(line.rstrip())
            line = indent + "  "
        line += item + " "
    lines.append(line.rstrip())
    return "\n".join(lines)


_KNOBS_RE = re.compile(r"^(?P<indent> +)knobs: \[(?P<body>[^\]]*)\]", re.MULTILINE)
_STAGE_RE = re.compile(r"^  (?P<name>[a-z_]+):\s*$", re.MULTILINE)


def with_stage_knobs(text: str, root: Path = ROOT) -> str:
    """playbooks/vars/stages.yml with every stage's ``knobs:`` list derived (the rest as written)."""
    if KNOBS_MARK not in text:
        raise ValueError(f"no header line {KNOBS_MARK!r}")
    out, pos = [], 0
    for m in _KNOBS_RE.finditer(text):
        stage = [s["name"] for s in _STAGE_RE.finditer(text, 0, m.start())][-1]
        out += [text[pos:m.start()], f"{m['indent']}knobs: [\n",
                _knobs_block(stage_knobs(stage, root), m["indent"])]
        pos = m.end()
    return "".join(out) + text[pos:]


def main(argv: list[str] | None = None) -> int:
    ap = doc_parser("role_docs.py", __doc__)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is stale")
    ap.add_argument(
        "--roles", type=Path, default=ROOT / "roles", help="roles directory (default: %(default)s)"
    )
    a = ap.parse_args(argv)
    stale = []
    methods = catalogue_methods()
    for role in sorted(p for p in a.roles.iterdir() if (p / "meta" / "argument_specs.yml").is_file()):
        spec_file = role / "meta" / "argument_specs.yml"
        spec_text = spec_file.read_text()
        new_spec = without_repeated_defaults(with_method_choices(spec_text, methods), role_defaults(role))
        if new_spec != spec_text:
            if a.check:
                if with_method_choices(spec_text, methods) != spec_text:
                    stale.append(f"{spec_file}: method choices differ from spark_method_catalogue")
                if without_repeated_defaults(spec_text, role_defaults(role)) != spec_text:
                    stale.append(f"{spec_file}: a default repeats defaults/main.yml's or group_vars' value")
            else:
                spec_file.write_text(new_spec)
                print(f"updated {spec_file}")
        readme = role / "README.md"
        text = readme.read_text() if readme.is_file() else ""
        try:
            new = updated(text, table(role))
        except ValueError:
            stale.append(f"{readme}: missing (or without the markers {BEGIN!r} ... {END!r})")
            continue
        if new != text:
            if a.check:
                stale.append(f"{readme}: variable table differs from meta/argument_specs.yml")
            else:
                readme.write_text(new)
                print(f"updated {readme}")
    stages = a.roles.parent / STAGES.relative_to(ROOT)
    if stages.is_file():
        text = stages.read_text(encoding="utf-8")
        try:
            new = with_stage_knobs(text, a.roles.parent)
        except ValueError as exc:
            stale.append(f"{stages}: {exc}")
        else:
            if new != text and a.check:
                stale.append(f"{stages}: a stage's knobs differ from what its roles declare and read")
            elif new != text:
                stages.write_text(new, encoding="utf-8")
                print(f"updated {stages}")
    for line in stale:
        print(line, file=sys.stderr)
    if stale and a.check:
        print("run: .venv/bin/python scripts/role_docs.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
