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

    .venv/bin/python scripts/role_docs.py            # rewrite the tables
    .venv/bin/python scripts/role_docs.py --check    # exit 1 when a table differs
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
    for line in stale:
        print(line, file=sys.stderr)
    if stale and a.check:
        print("run: .venv/bin/python scripts/role_docs.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
