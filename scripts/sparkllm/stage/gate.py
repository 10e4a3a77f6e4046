"""The stage shortcut of site.yml, both halves: may a stage end at once because nothing changed?

A stage is *current* on a host when
  * its fingerprint (the inputs it depends on, computed on the controller by the
    ``spark_stage_gate`` filter, filter_plugins/spark_stage.py) equals the one it recorded on the host
    the last time it completed, and
  * the outputs it recorded then are still what the host has now (the ``spark_stage`` module,
    library/spark_stage.py, observes them in one call per run: image IDs, model directory listings,
    unit states, boot ID).

What a stage is comes from one file, ``playbooks/vars/stages.yml`` (``spark_stages``), which the stage
playbooks load too: its playbooks, the stages it builds on (``after``), its knobs (every variable a
user can set that it reads), its force knobs, the run-time facts it reads (set by an earlier stage or
play, covered by ``after``) and its outputs. The roles of a stage are the ones its playbooks run
(``roles:``, ``import_role``/``include_role``, and their meta dependencies), read from the playbooks.
tests/unit/test_stage_inputs.py fails when a file of a stage reads a variable the stage does not
declare.

Inputs of a stage:
  * the value in effect on the host of each declared knob (inventory, group_vars, ``-e``); secrets
    (``*_token``) enter as an HMAC under a per-host salt;
  * the content of the toolkit files it runs (its roles, or the task files it includes from a role,
    its playbooks, shared plugins, scripts, templates, patches, group_vars, the stage file);
  * the recorded state of the stages it builds on (serve: build and model; bench: serve).

This module is imported on the controller as ``sparkllm.stage.gate`` (the filter plugin) and shipped to the
host as ``ansible.module_utils.sparkllm.stage.gate`` (the module; ansible.cfg's module_utils is scripts/):
the host half uses the standard library only, the controller half imports PyYAML when it runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the checkout (scripts/sparkllm/stage/gate.py)
STAGES_FILE = Path("playbooks") / "vars" / "stages.yml"
STAGES_VAR = "spark_stages"

# Toolkit files every stage runs or may run: a change here reruns every stage once.
SHARED_PATHS = ("filter_plugins", "library", "scripts", "templates", "patches", "group_vars",
                "site.yml", "playbooks/validate.yml", str(STAGES_FILE))
SECRET_RE = re.compile(r"(^|_)(token|secret|password|api_key)$")
# Inputs naming a file or directory on the controller that the stage renders or applies.
CONTROLLER_FILE_RE = re.compile(r"(_template|_patches_root)$")
# Names a template may mention that are never inputs: facts and Ansible's own variables.
NOT_INPUT_RE = re.compile(r"^(ansible_|inventory_|group_names$|groups$|hostvars$|play_hosts$|omit$)")
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
DECLARATION_KEYS = ("playbooks", "after", "knobs", "force", "facts", "outputs")

# What a stage may declare as its outputs, observed on the host by the module.
OUTPUT_KINDS = ("files", "dirs", "images", "units", "boot")
FACT = "spark_stage.fact"
HASH_LIMIT = 64 * 1024 * 1024  # larger files are observed by size and mtime, not read

ROLE_ACTIONS = {f"{p}{a}" for p in ("", "ansible.builtin.") for a in ("import_role", "include_role")}
TASK_ACTIONS = {f"{p}{a}" for p in ("", "ansible.builtin.") for a in ("import_tasks", "include_tasks")}
TASK_LISTS = ("pre_tasks", "tasks", "post_tasks", "handlers", "block", "rescue", "always")


# --- the declaration: playbooks/vars/stages.yml ------------------------------------------------

@dataclass(frozen=True)
class Stage:
    name: str
    playbooks: tuple[str, ...]
    after: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    force: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()
    outputs: Mapping[str, Any] = field(default_factory=dict)


_decl_cache: dict[tuple[str, int], dict[str, Stage]] = {}


def declarations(root: Path = ROOT) -> dict[str, Stage]:
    """Every stage as ``playbooks/vars/stages.yml`` declares it, in the file's order."""
    import yaml  # controller only

    path = Path(root) / STAGES_FILE
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _decl_cache:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        raw = doc.get(STAGES_VAR)
        if not isinstance(raw, Mapping) or not raw:
            raise ValueError(f"{STAGES_FILE}: {STAGES_VAR} must map each stage name to its declaration")
        out = {}
        for name, spec in raw.items():
            unknown = sorted(set(spec or {}) - set(DECLARATION_KEYS))
            if unknown or not (spec or {}).get("playbooks"):
                got = ", ".join(unknown) or "no playbooks"
                raise ValueError(f"{STAGES_FILE}: stage {name!r} needs playbooks and may declare only "
                                 f"{', '.join(DECLARATION_KEYS)} (got {got})")
            out[name] = Stage(name=name, outputs=dict(spec.get("outputs") or {}),
                              **{k: tuple(spec.get(k) or ()) for k in DECLARATION_KEYS if k != "outputs"})
        _decl_cache.clear()
        _decl_cache[key] = out
    return _decl_cache[key]


def stage_names(root: Path = ROOT) -> list[str]:
    return list(declarations(root))


def _stage(stage: str, root: Path = ROOT) -> Stage:
    decl = declarations(root)
    if stage not in decl:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(decl)} ({STAGES_FILE})")
    return decl[stage]


# --- the roles a stage runs, read from its playbooks --------------------------------------------

def _yaml(path: Path) -> Any:
    import yaml  # controller only

    return yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None


def _task_calls(tasks: Any) -> Iterable[tuple[str, Any]]:
    """(action, arguments) of every task in a task list, blocks included."""
    for task in tasks if isinstance(tasks, list) else []:
        if not isinstance(task, Mapping):
            continue
        for key in ("block", "rescue", "always"):
            yield from _task_calls(task.get(key))
        for action in ROLE_ACTIONS | TASK_ACTIONS:
            if action in task:
                yield action, task[action]


def _role_call(args: Any, where: str) -> tuple[str, str | None]:
    args = {"name": args} if isinstance(args, str) else dict(args or {})
    name, tasks_from = args.get("name") or args.get("role"), args.get("tasks_from")
    if not isinstance(name, str) or "{{" in name or "{{" in str(tasks_from or ""):
        raise ValueError(f"{where}: a role included by a templated name cannot be a stage's known role")
    if tasks_from and not str(tasks_from).endswith((".yml", ".yaml")):
        tasks_from = f"{tasks_from}.yml"
    return name, tasks_from


def stage_roles(stage: str, root: Path = ROOT) -> dict[str, frozenset[str] | None]:
    """The roles the stage's playbooks run: role -> None (the whole role: ``roles:``, an import or
    include without ``tasks_from``, a meta dependency) or the task files it runs (``tasks_from`` and
    the files those include)."""
    root = Path(root)
    whole: set[str] = set()
    parts: dict[str, set[str]] = {}
    todo: list[tuple[str, str | None, str]] = []

    def calls(tasks: Any, where: str, role: str | None = None) -> None:
        for action, args in _task_calls(tasks):
            if action in ROLE_ACTIONS:
                todo.append((*_role_call(args, where), where))
            elif role is not None and isinstance(args, str | Mapping):
                name = args if isinstance(args, str) else args.get("file")
                if isinstance(name, str) and "{{" not in name:
                    todo.append((role, name, where))

    for pb in _stage(stage, root).playbooks:
        for play in _yaml(root / "playbooks" / pb) or []:
            for entry in play.get("roles") or []:
                todo.append((*_role_call(entry, pb), pb))
            for key in TASK_LISTS:
                calls(play.get(key), pb)
    while todo:
        role, tasks_from, where = todo.pop()
        base = root / "roles" / role
        if not base.is_dir():
            raise ValueError(f"{where}: role {role!r} is not in roles/")
        if tasks_from is None:
            if role in whole:
                continue
            whole.add(role)
            for dep in (_yaml(base / "meta" / "main.yml") or {}).get("dependencies") or []:
                todo.append((*_role_call(dep, f"roles/{role}/meta/main.yml"), f"roles/{role}/meta"))
            for f in sorted((base / "tasks").glob("*.y*ml")):
                calls(_yaml(f), f"roles/{role}/tasks/{f.name}")
        elif tasks_from not in parts.setdefault(role, set()):
            parts[role].add(tasks_from)
            calls(_yaml(base / "tasks" / tasks_from), f"roles/{role}/tasks/{tasks_from}", role)
    out: dict[str, frozenset[str] | None] = {r: None for r in sorted(whole)}
    out.update({r: frozenset(f) for r, f in sorted(parts.items()) if r not in whole})
    return out


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and not SKIP_PARTS.intersection(p.parts) and p.suffix != ".pyc")


def stage_paths(stage: str, root: Path = ROOT) -> list[Path]:
    """The toolkit files and folders the stage runs: its playbooks, its roles (whole, or the task
    files it includes with their role's defaults, vars and meta), and the shared ones."""
    root = Path(root)
    out = [root / "playbooks" / p for p in _stage(stage, root).playbooks]
    for role, tasks in stage_roles(stage, root).items():
        base = root / "roles" / role
        if tasks is None:
            out.append(base)
        else:
            out += [base / "tasks" / t for t in sorted(tasks)]
            out += [base / d for d in ("defaults", "vars", "meta")]
    return out + [root / p for p in SHARED_PATHS]


_digest_cache: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digest_cache:
        _digest_cache[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _digest_cache[key]


def files_digest(stage: str, root: Path = ROOT) -> str:
    """sha256 over (relative path, content sha256) of every toolkit file the stage runs."""
    h = hashlib.sha256()
    for base in stage_paths(stage, root):
        for f in _files(base):
            h.update(f"{f.relative_to(root).as_posix()}\0{_file_digest(f)}\n".encode())
    return h.hexdigest()


# --- the controller half: inputs, fingerprint, decision ----------------------------------------

def input_names(stage: str, root: Path = ROOT) -> list[str]:
    """The knobs the stage declares (force knobs and run-time facts are no inputs)."""
    return sorted(_stage(stage, root).knobs)


def force_names(stage: str, root: Path = ROOT) -> list[str]:
    """The knobs that ask the stage for its work regardless of the fingerprint."""
    return sorted(_stage(stage, root).force)


def _plain(value: Any) -> Any:
    """A JSON-stable copy of a templated value (mappings sorted, sequences as lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _resolved(hostvars: Mapping[str, Any], name: str) -> Any:
    """The templated value of ``name``; one that cannot be resolved yet is a marker, the same every run."""
    try:
        return _plain(hostvars[name])
    except Exception as exc:  # noqa: BLE001 - an unresolvable value is still a stable input
        return f"<unresolved: {type(exc).__name__}>"


def input_values(stage: str, hostvars: Mapping[str, Any], salt: str, root: Path = ROOT) -> dict[str, Any]:
    """The value in effect of each declared knob the inventory, group_vars or ``-e`` sets (role
    defaults that are not overridden are covered by the files digest). A value that cannot be
    resolved yet enters as a marker, the same on every run."""
    out: dict[str, Any] = {}
    for name in input_names(stage, root):
        if name not in hostvars:
            continue
        value = _resolved(hostvars, name)
        if SECRET_RE.search(name) and value not in ("", None):
            value = "hmac:" + hmac.new(salt.encode(), json.dumps(value).encode(), hashlib.sha256).hexdigest()
        out[name] = value
    # A template or patch directory the user points the stage at (outside the toolkit's own files):
    # its content is an input, and so is every variable a template mentions (a custom template may
    # read knobs no role declares).
    for name in list(out):
        if not CONTROLLER_FILE_RE.search(name) or not isinstance(out[name], str) or not out[name]:
            continue
        path = Path(out[name])
        files = _files(path)
        if not files:
            continue
        h = hashlib.sha256()
        words: set[str] = set()
        for f in files:
            rel = f.relative_to(path).as_posix() if path.is_dir() else f.name
            h.update(f"{rel}\0{_file_digest(f)}\n".encode())
            if f.suffix == ".j2":
                words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*",
                                        f.read_text(encoding="utf-8", errors="replace")))
        out[f"<content of {name}>"] = h.hexdigest()
        for word in sorted(words - set(out)):
            if (word in hostvars and not word.startswith("_") and not SECRET_RE.search(word)
                    and not NOT_INPUT_RE.search(word)):
                out[word] = _resolved(hostvars, word)
    return out


def fingerprint(stage: str, values: Mapping[str, Any], upstream: Mapping[str, Any], root: Path = ROOT) -> str:
    doc = {"stage": stage, "inputs": _plain(values), "files": files_digest(stage, root),
           "after": _plain(upstream)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "on")
    return bool(value)


def _safe(hostvars: Mapping[str, Any], name: str) -> Any:
    try:
        return hostvars[name]
    except Exception:  # noqa: BLE001
        return False


def gate(stage: str, hostvars: Mapping[str, Any], probe: Mapping[str, Any] | None,
         force: Any = False, root: Path = ROOT) -> dict[str, Any]:
    """Decide whether ``stage`` may end at once on this host. ``probe`` is the module's probe result
    (recorded stages, whether their outputs still match, the salt)."""
    probe = probe or {}
    recorded = probe.get("stages") or {}
    salt = str(probe.get("salt") or "")
    spec = _stage(stage, root)
    upstream = {u: {"fingerprint": (recorded.get(u) or {}).get("fingerprint", ""),
                    "observed": (recorded.get(u) or {}).get("observed", "")} for u in spec.after}
    fp = fingerprint(stage, input_values(stage, hostvars, salt, root), upstream, root)
    forced = [n for n in force_names(stage, root) if n in hostvars and _truthy(_safe(hostvars, n))]
    mine = recorded.get(stage) or {}
    if _truthy(force):
        current, reason = False, "spark_stage_force is set"
    elif forced:
        current, reason = False, f"{', '.join(forced)} asks for the work"
    elif not mine:
        current, reason = False, "no record of a completed run on this host"
    elif mine.get("fingerprint") != fp:
        current, reason = False, "its inputs changed since the last completed run"
    elif not mine.get("outputs_match", False):
        drift = "; ".join(mine.get("drift") or []) or "its outputs changed"
        current, reason = False, f"its outputs changed: {drift}"
    else:
        current, reason = True, "inputs and outputs unchanged since the last completed run"
    return {"stage": stage, "current": current, "fingerprint": fp, "reason": reason}


def probe_entry(fingerprint: str, observed: str, drift: list[str]) -> dict[str, Any]:
    """What a probe reports for one recorded stage (the module, and after_record for a new record)."""
    return {"fingerprint": fingerprint, "observed": observed, "outputs_match": not drift, "drift": drift}


def after_record(probe: Mapping[str, Any] | None, stage: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """The probe as the stages after ``stage`` should see it: with the record just written."""
    out = dict(probe or {})
    stages = dict(out.get("stages") or {})
    entry = dict(record.get("entry") or {})
    stages[stage] = probe_entry(entry.get("fingerprint", ""), entry.get("observed", ""), [])
    out["stages"] = stages
    if record.get("salt"):
        out["salt"] = record["salt"]
    return out


# --- the host half: observe, probe, record (standard library only) ------------------------------

Runner = Callable[[list[str]], tuple[int, str, str]]


def read_fact(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _observe_file(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_size > HASH_LIMIT:
        return f"size={st.st_size} mtime={st.st_mtime_ns}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _observe_dir(path: str):
    if not os.path.isdir(path):
        return None
    h = hashlib.sha256()
    count = 0
    for base, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(base, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            h.update(f"{os.path.relpath(full, path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            count += 1
    return f"{count} files {h.hexdigest()}"


def _boot():
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def observe(outputs: Mapping[str, Any], run: Runner, which: Callable[[str], str | None]) -> dict:
    """What each declared output is now (None: missing)."""
    docker = which("docker") if outputs.get("images") else None
    systemctl = which("systemctl") if outputs.get("units") else None
    seen: dict = {}
    for path in outputs.get("files") or []:
        seen[f"file {path}"] = _observe_file(path)
    for path in outputs.get("dirs") or []:
        seen[f"dir {path}"] = _observe_dir(path)
    for name in outputs.get("images") or []:
        out = ""
        if docker:
            rc, out, _ = run([docker, "image", "inspect", "--format", "{{.Id}}", name])
            out = out.strip() if rc == 0 else ""
        seen[f"image {name}"] = out or None
    for name in outputs.get("units") or []:
        state = (run([systemctl, "is-active", name])[1].strip() or "unknown") if systemctl else None
        seen[f"unit {name}"] = state
    if outputs.get("boot"):
        seen["boot"] = _boot()
    return seen


def observed_digest(seen: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()


def drift(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            was, is_ = before.get(key), now.get(key)
            out.append(f"{key}: {'missing' if is_ is None else 'changed'}"
                       + ("" if was is not None else " (was missing)"))
    return out


def probe(data: Mapping[str, Any], run: Runner, which: Callable[[str], str | None]) -> dict[str, Any]:
    """Every recorded stage of a fact, with its outputs observed again."""
    stages = data.get("stages") if isinstance(data.get("stages"), Mapping) else {}
    report = {}
    for name, rec in stages.items():
        if isinstance(rec, Mapping):
            now = observe(rec.get("outputs") or {}, run, which)
            report[name] = probe_entry(rec.get("fingerprint", ""), observed_digest(now),
                                       drift(rec.get("seen") or {}, now))
    return report


def write_fact(path: str, data: Mapping[str, Any]) -> None:
    """Write the fact atomically (temporary file, fsync, rename), mode 0600."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".spark_stage.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
