"""Every variable a stage's files read is declared by the stage (playbooks/vars/stages.yml), so that
the stage gate (scripts/sparkllm/stage/gate.py) cannot miss an input and end a stage that has work to do.

The files of a stage: its playbooks, its roles (tasks, handlers, templates, defaults, vars; for a role
included with tasks_from, those task files and the role's defaults and vars) and the toolkit templates
those name. A name read there is declared when it is one of the stage's ``knobs`` (a value a user sets:
fingerprinted), ``force`` knobs or ``facts`` (set at run time by an earlier stage or play, covered by
``after``), or is defined in those files themselves (register, set_fact, vars, loop_var, role vars);
Ansible's magic variables and facts need no declaration. Every default of a role the stage runs whole
is a knob of it too, read or not (a user may set it). Declarations that nothing reads are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import jinja2
import pytest
import yaml
from jinja2 import meta, nodes
from role_docs import GATE_KNOBS, SET_FACT, yaml_strings  # the generator's own YAML reading (scripts/)
from sparkllm.stage import gate as st

ROOT = Path(__file__).resolve().parents[2]
STAGES_FILE = st.STAGES_FILE.as_posix()

# Ansible's own variables, Jinja's globals and the facts (ansible_* are all magic or facts).
MAGIC = {"inventory_hostname", "inventory_hostname_short", "groups", "group_names", "hostvars", "play_hosts",
         "omit", "playbook_dir", "role_path", "role_name", "role_names", "item", "inventory_dir",
         "inventory_file", "vars", "environment", "lookup", "query", "q", "now", "range", "dict", "lipsum",
         "cycler", "joiner", "namespace", "undef", "_", "true", "false", "none", "True", "False", "None"}
MAGIC_RE = re.compile(r"^ansible_")
# The filter that picks every serving setting out of hostvars: its names are read without being written.
SETTINGS_FILTER = "spark_settings"


class _AnyName(dict):
    """Every filter and test name is known (Ansible's and ours: only the variables matter here)."""

    def __contains__(self, key):
        return True

    def get(self, key, default=None):
        return super().get(key) or (lambda *a, **k: None)


ENV = jinja2.Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"])
ENV.filters, ENV.tests = _AnyName(ENV.filters), _AnyName(ENV.tests)


@dataclass
class Reads:
    """What a stage's files read (name -> first file that reads it) and define."""
    reads: dict[str, str] = field(default_factory=dict)
    defines: set[str] = field(default_factory=set)
    defaults: dict[str, str] = field(default_factory=dict)
    # what the defaults of a role included only for some task files read, per default: it counts
    # when that default is read
    partial: dict[str, dict[str, str]] = field(default_factory=dict)

    def read(self, names, where: str) -> None:
        for name in names:
            self.reads.setdefault(name, where)


def _template_names(text: str, where: str) -> set[str]:
    """The variables a template reads (its own {% set %} and loop names are not)."""
    try:
        ast = ENV.parse(text)
        names = set(meta.find_undeclared_variables(ast))
    except jinja2.TemplateSyntaxError as exc:
        raise AssertionError(f"{where}: cannot parse a template: {exc}") from exc
    local = {n.name for node in ast.find_all((nodes.Assign, nodes.For, nodes.AssignBlock))
             for n in [node.target, *node.target.find_all(nodes.Name)] if isinstance(n, nodes.Name)}
    return names - local


@cache
def settings_names() -> frozenset[str]:
    """The names ``hostvars | spark_settings`` reads (asked of a mapping that records the questions)."""
    import spark_methods

    class Recorder(dict):
        asked: set[str] = set()

        def __contains__(self, key):
            self.asked.add(key)
            return False

    rec = Recorder()
    spark_methods.spark_settings(rec)
    return frozenset(rec.asked)


def _definitions(node, out: set[str]) -> None:
    """Names a task file defines: register, set_fact, vars, loop_var/index_var."""
    if isinstance(node, list):
        for v in node:
            _definitions(v, out)
    elif isinstance(node, dict):
        if isinstance(node.get("register"), str):
            out.add(node["register"])
        for action in SET_FACT & set(node):
            out.update(k for k in (node[action] or {}) if k != "cacheable")
        if isinstance(node.get("vars"), dict):
            out.update(node["vars"])
        lc = node.get("loop_control") or {}
        out.update(v for k, v in lc.items() if k in ("loop_var", "index_var") and isinstance(v, str))
        for v in node.values():
            _definitions(v, out)


def _scan_yaml(path: Path, reads: Reads, kind: str = "tasks") -> None:
    where = path.relative_to(ROOT).as_posix()
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if kind == "partial defaults" and isinstance(doc, dict):
        for key, value in doc.items():
            sub = Reads()
            for text, _bare in yaml_strings(value):
                if "{{" in text or "{%" in text:
                    sub.read(_template_names(text, where), where)
            reads.partial[key] = sub.reads
        return
    if kind in ("defaults", "vars") and isinstance(doc, dict):
        # a default is a knob, but one named _* is the role's own (as its vars are)
        reads.defaults.update({k: where for k in doc if kind == "defaults" and not k.startswith("_")})
        reads.defines.update(k for k in doc if kind == "vars" or k.startswith("_"))
    elif kind.startswith("stage "):
        reads.defines.add(st.STAGES_VAR)  # the play loads the file (vars_files)
        doc = doc[st.STAGES_VAR][kind.split()[1]]
        where = f"{where} ({st.STAGES_VAR}.{kind.split()[1]})"
    elif kind.startswith("options "):
        # the arguments a play passes to a role's task file (its entry point's options)
        spec = (doc or {}).get("argument_specs", {}).get(kind.split()[1]) or {}
        knobs = yaml.safe_load((path.parents[1] / "defaults" / "main.yml").read_text(encoding="utf-8")) or {}
        reads.defines.update(set(spec.get("options") or {}) - set(knobs))
        return
    else:
        _definitions(doc, reads.defines)
    for text, bare in yaml_strings(doc):
        if bare:
            text = "{{ " + text + " }}"
        elif "{{" not in text and "{%" not in text:
            continue
        reads.read(_template_names(text, where), where)
        if SETTINGS_FILTER in text and "hostvars" in text:
            reads.read(settings_names(), f"{where} (hostvars | {SETTINGS_FILTER})")


def _scan_template(path: Path, reads: Reads) -> None:
    where = path.relative_to(ROOT).as_posix()
    reads.read(_template_names(path.read_text(encoding="utf-8"), where), where)


def stage_files(stage: str) -> list[tuple[Path, str]]:
    """(file, kind) of every file of the stage whose variables count."""
    out = [(ROOT / "playbooks" / p, "tasks") for p in st.declarations()[stage].playbooks]
    out.append((ROOT / st.STAGES_FILE, f"stage {stage}"))
    for role, tasks in st.stage_roles(stage).items():
        base = ROOT / "roles" / role
        for kind in ("defaults", "vars"):
            if (base / kind / "main.yml").is_file():
                partial = tasks is not None and kind == "defaults"
                out.append((base / kind / "main.yml", "partial defaults" if partial else kind))
        if (base / "meta" / "argument_specs.yml").is_file():
            specs = yaml.safe_load((base / "meta" / "argument_specs.yml").read_text(encoding="utf-8"))
            entries = [Path(t).stem for t in sorted(tasks or ())] or [
                e for e in specs["argument_specs"] if e != "main"]
            out += [(base / "meta" / "argument_specs.yml", f"options {e}") for e in entries]
        if tasks is None:
            out += [(f, "tasks") for d in ("tasks", "handlers") for f in sorted((base / d).glob("*.yml"))]
            out += [(f, "template") for d in ("templates", "files") for f in sorted((base / d).rglob("*.j2"))]
        else:
            out += [(base / "tasks" / t, "tasks") for t in sorted(tasks)]
    # the toolkit's own templates (templates/) a role points a knob at, by file name
    text = "\n".join(p.read_text(encoding="utf-8") for p, _ in out)
    out += [(t, "template") for t in sorted((ROOT / "templates").rglob("*.j2")) if t.name in text]
    return out


@cache
def stage_reads(stage: str) -> Reads:
    return scan_stage(stage)


def scan_stage(stage: str) -> Reads:
    reads = Reads()
    for path, kind in stage_files(stage):
        (_scan_template(path, reads) if kind == "template" else _scan_yaml(path, reads, kind))
    todo = [n for n in reads.reads if n in reads.partial]
    while todo:
        for name, where in reads.partial.pop(todo.pop(), {}).items():
            if name not in reads.reads:
                reads.read([name], where)
                if name in reads.partial:
                    todo.append(name)
    return reads


def undeclared(stage: str, reads: Reads | None = None) -> list[str]:
    """One message per variable the stage's files read, or default, that the stage does not declare."""
    decl = st.declarations()[stage]
    declared = set(decl.knobs) | set(decl.force) | set(decl.facts)
    reads = reads or stage_reads(stage)
    wanted = {n: w for n, w in reads.reads.items()
              if n not in reads.defines | MAGIC | GATE_KNOBS and not MAGIC_RE.match(n)}
    whole = [r for r, t in st.stage_roles(stage).items() if t is None]
    for name, where in reads.defaults.items():
        if any(where.startswith(f"roles/{r}/") for r in whole):
            wanted.setdefault(name, where)
    return [f"{where} reads `{name}`, which stage `{stage}` does not declare: add `{name}` to "
            f"{st.STAGES_VAR}.{stage}.knobs in {STAGES_FILE} (a value a user sets), or to "
            f"{st.STAGES_VAR}.{stage}.facts (set at run time by an earlier stage or play)"
            for name, where in sorted(wanted.items()) if name not in declared]


@pytest.mark.parametrize("stage", st.stage_names())
def test_every_variable_a_stage_reads_is_declared(stage):
    errors = undeclared(stage)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("stage", st.stage_names())
def test_a_stage_declares_nothing_its_files_do_not_read(stage):
    decl = st.declarations()[stage]
    reads = stage_reads(stage)
    read = set(reads.reads) | set(reads.defaults)
    stale = [f"{st.STAGES_VAR}.{stage}.{kind} in {STAGES_FILE} lists `{name}`, which no file of the "
             f"stage reads: remove it" for kind in ("knobs", "force", "facts")
             for name in getattr(decl, kind) if name not in read]
    assert not stale, "\n".join(stale)
    both = sorted(set(decl.knobs) & (set(decl.force) | set(decl.facts)))
    assert not both, f"{stage}: {both} declared twice (knobs are fingerprinted, force knobs and facts not)"


def test_the_check_fails_on_a_variable_a_role_reads_undeclared(monkeypatch):
    """The check itself: a template that reads a new variable is named, with what to add where."""
    real = _scan_template

    def with_new_knob(path, reads):
        real(path, reads)
        if path.name == "sparkllm-vllm.service.j2":
            reads.read({"serve_new_knob"}, path.relative_to(ROOT).as_posix())

    monkeypatch.setitem(globals(), "_scan_template", with_new_knob)
    errors = [e for e in undeclared("serve", scan_stage("serve")) if "serve_new_knob" in e]
    assert errors == [
        "templates/sparkllm-vllm.service.j2 reads `serve_new_knob`, which stage `serve` does not declare: "
        "add `serve_new_knob` to spark_stages.serve.knobs in playbooks/vars/stages.yml "
        "(a value a user sets), or to spark_stages.serve.facts (set at run time by an earlier stage or play)"]


def test_the_declaration_matches_the_playbooks_and_the_module():
    decl = st.declarations()
    for name, spec in decl.items():
        assert set(spec.after) <= set(decl) - {name}, name
        kinds = set(spec.outputs) - set(st.OUTPUT_KINDS)
        assert not kinds, f"{name}: output kind(s) {sorted(kinds)} are not {st.OUTPUT_KINDS}"
        for pb in spec.playbooks:
            plays = yaml.safe_load((ROOT / "playbooks" / pb).read_text(encoding="utf-8"))
            gated = [t["vars"]["spark_tools_stage"] for p in plays for t in p.get("pre_tasks") or []
                     if "spark_tools_stage" in (t.get("vars") or {})]
            assert gated == [name], f"playbooks/{pb} gates {gated}, {STAGES_FILE} says {name}"
            assert all("vars/stages.yml" in (p.get("vars_files") or []) for p in plays), pb
    # the gate's argument specs take exactly the declared stages
    specs = yaml.safe_load((ROOT / "roles/spark_tools/meta/argument_specs.yml").read_text(encoding="utf-8"))
    for entry in ("stage_gate", "stage_record"):
        choices = specs["argument_specs"][entry]["options"]["spark_tools_stage"]["choices"]
        assert choices == list(decl), f"roles/spark_tools/meta/argument_specs.yml {entry}: choices {choices}"
    # every playbook that gates a stage is some stage's
    for pb in sorted((ROOT / "playbooks").glob("*.yml")):
        if "stage_gate.yml" in pb.read_text(encoding="utf-8"):
            assert any(pb.name in s.playbooks for s in decl.values()), pb.name


# Read with a default by a role's defaults, defined by no file (a user may set it in the inventory).
OPTIONAL_KNOBS = {"spark_ray_env_exclude_file"}


def test_every_declared_knob_is_defined_somewhere():
    """A misspelt knob in the declaration would be an input nothing sets: every one is a name the
    toolkit knows (defaults, group_vars, argument specs, plays: filter_plugins/spark_knobs.py) or a
    serving setting (hostvars | spark_settings)."""
    import spark_knobs

    known = spark_knobs.spark_known_knobs()
    known = set(known["knobs"]) | set(known["internal"]) | settings_names() | OPTIONAL_KNOBS
    for name, spec in st.declarations().items():
        missing = sorted((set(spec.knobs) | set(spec.force)) - known)
        assert not missing, f"{name}: {missing} are in no role's defaults and no group_vars/all file"
