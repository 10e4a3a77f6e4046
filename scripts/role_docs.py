#!/usr/bin/env python3
"""Write each role's variable table into its README from meta/argument_specs.yml (controller tool).

The table sits between two marker lines in roles/<role>/README.md; everything else in the README is
prose written by hand. ``--check`` changes nothing and exits 1 naming the READMEs whose table is stale
(the unit tests run it), so a knob added to the argument specs cannot go undocumented.

    .venv/bin/python scripts/role_docs.py            # rewrite the tables
    .venv/bin/python scripts/role_docs.py --check    # exit 1 when a table differs
"""

from __future__ import annotations

import json
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


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(name: str, opt: dict, defaults: dict) -> str:
    value = opt["default"] if "default" in opt else defaults.get(name)
    if "default" not in opt and name not in defaults:
        return "required" if opt.get("required") else ""
    shown = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    if len(shown) > MAX_DEFAULT:
        return "see `defaults/main.yml`"
    return f"`{_cell(shown)}`" if shown != "" else '`""`'


def table(role: Path) -> str:
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    defaults_file = role / "defaults" / "main.yml"
    defaults = (yaml.safe_load(defaults_file.read_text()) or {}) if defaults_file.is_file() else {}
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
            lines.append(f"| `{name}` | {typ} | {_default(name, opt, defaults)} | {_cell(desc)} |")
    lines += ["", END]
    return "\n".join(lines)


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
    for role in sorted(p for p in a.roles.iterdir() if (p / "meta" / "argument_specs.yml").is_file()):
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
