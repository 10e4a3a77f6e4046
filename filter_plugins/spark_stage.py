"""One fingerprint per stage: may a stage of site.yml end at once because nothing changed?

A stage is *current* on a host when
  * its fingerprint (the inputs it depends on, computed here on the controller) equals the one it
    recorded on the host the last time it completed, and
  * the outputs it recorded then are still what the host has now (the ``spark_stage`` module
    observes them in one call per run: image IDs, model directory listings, unit states, boot ID).

Inputs of a stage:
  * every variable a user can set that the stage reads: the keys of its roles' defaults, and the
    keys of ``group_vars/all`` its roles' files mention, with the value in effect on the host
    (inventory, group_vars, ``-e``); secrets (``*_token``) enter as an HMAC under a per-host salt;
  * the content of the toolkit files it runs (its roles, shared plugins, scripts, templates,
    patches, group_vars, its playbook);
  * the recorded state of the stages it builds on (serve: build and model; bench: serve).

Force knobs (``*_force``, ``*_update``) and ``spark_stage_force`` bypass the shortcut and
are not inputs. Filters:

- ``spark_stage_gate``: the decision (``current``, ``fingerprint``, ``reason``) for one stage.
- ``spark_stage_input_names``: the variable names a stage depends on (for the tests and the docs).
- ``spark_stage_after_record``: the probe with one stage's new record, for the stages after it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stage:
    roles: tuple[str, ...]
    playbooks: tuple[str, ...]
    after: tuple[str, ...] = ()


STAGES: dict[str, Stage] = {
    "preflight": Stage(roles=("preflight",), playbooks=("preflight.yml",)),
    "build": Stage(roles=("vllm_build", "spark_tools"), playbooks=("build.yml",)),
    "model": Stage(roles=("model_fetch", "model_hybrid", "spark_tools"), playbooks=("model.yml",)),
    "serve": Stage(roles=("serve",), playbooks=("serve.yml",), after=("build", "model")),
    "bench": Stage(roles=("bench",), playbooks=("bench.yml",), after=("serve",)),
    "ops": Stage(roles=("spark_ops",), playbooks=("ops.yml",), after=("serve",)),
}
# Toolkit files every stage runs or may run: a change here reruns every stage once.
SHARED_PATHS = ("filter_plugins", "library", "scripts", "templates", "patches", "group_vars",
                "site.yml", "playbooks/validate.yml")
# Knobs that ask for work regardless of the fingerprint; never part of it.
FORCE_RE = re.compile(r"(_force|_update)$")
SECRET_RE = re.compile(r"(^|_)(token|secret|password|api_key)$")
# Inputs naming a file or directory on the controller that the stage renders or applies.
CONTROLLER_FILE_RE = re.compile(r"(_template|_patches_root)$")
# Names a template may mention that are never inputs: facts and Ansible's own variables.
NOT_INPUT_RE = re.compile(r"^(ansible_|inventory_|group_names$|groups$|hostvars$|play_hosts$|omit$)")
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
TOP_KEY_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):", re.M)

_digest_cache: dict[tuple[str, int, int], str] = {}


def _top_keys(path: Path) -> list[str]:
    """Top-level keys of a YAML vars file (read as text: one ``name:`` per line at column 0)."""
    return TOP_KEY_RE.findall(path.read_text(encoding="utf-8")) if path.is_file() else []


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and not SKIP_PARTS.intersection(p.parts) and p.suffix != ".pyc")


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digest_cache:
        _digest_cache[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _digest_cache[key]


def stage_paths(stage: str, root: Path = ROOT) -> list[Path]:
    spec = _stage(stage)
    return ([root / "roles" / r for r in spec.roles] + [root / "playbooks" / p for p in spec.playbooks]
            + [root / p for p in SHARED_PATHS])


def files_digest(stage: str, root: Path = ROOT) -> str:
    """sha256 over (relative path, content sha256) of every toolkit file the stage runs."""
    h = hashlib.sha256()
    for base in stage_paths(stage, root):
        for f in _files(base):
            h.update(f"{f.relative_to(root).as_posix()}\0{_file_digest(f)}\n".encode())
    return h.hexdigest()


def _stage(stage: str) -> Stage:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    return STAGES[stage]


def input_names(stage: str, root: Path = ROOT) -> list[str]:
    """Variables the stage depends on: its roles' defaults, and the group_vars its roles mention."""
    spec = _stage(stage)
    names: set[str] = set()
    text = []
    for role in spec.roles:
        names.update(_top_keys(root / "roles" / role / "defaults" / "main.yml"))
        text += [f.read_text(encoding="utf-8", errors="replace") for f in _files(root / "roles" / role)]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(text)))
    for f in _files(root / "group_vars"):
        names.update(k for k in _top_keys(f) if k in words)
    return sorted(n for n in names if not FORCE_RE.search(n))


def _plain(value: Any) -> Any:
    """A JSON-stable copy of a templated value (mappings sorted, sequences as lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _resolved(hostvars: Mapping[str, Any], name: str) -> Any:
    """The templated value of ``name``; one that cannot be resolved yet is a marker, the same every run."""
    try:
        return _plain(hostvars[name])
    except Exception as exc:  # noqa: BLE001 - an unresolvable value is still a stable input
        return f"<unresolved: {type(exc).__name__}>"


def input_values(stage: str, hostvars: Mapping[str, Any], salt: str, root: Path = ROOT) -> dict[str, Any]:
    """The value in effect of each input the inventory or ``-e`` sets (role defaults that are not
    overridden are covered by the files digest). A value that cannot be resolved yet enters as a
    marker, the same on every run."""
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


def spark_stage_gate(stage: str, hostvars: Mapping[str, Any], probe: Mapping[str, Any] | None,
                     force: Any = False) -> dict[str, Any]:
    """Decide whether ``stage`` may end at once on this host. ``probe`` is the ``spark_stage``
    module's probe result (recorded stages, whether their outputs still match, the salt)."""
    probe = probe or {}
    recorded = probe.get("stages") or {}
    salt = str(probe.get("salt") or "")
    spec = _stage(stage)
    upstream = {u: {"fingerprint": (recorded.get(u) or {}).get("fingerprint", ""),
                    "observed": (recorded.get(u) or {}).get("observed", "")} for u in spec.after}
    fp = fingerprint(stage, input_values(stage, hostvars, salt), upstream)
    forced = [n for n in force_names(stage) if n in hostvars and _truthy(_safe(hostvars, n))]
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


def _safe(hostvars: Mapping[str, Any], name: str) -> Any:
    try:
        return hostvars[name]
    except Exception:  # noqa: BLE001
        return False


def force_names(stage: str, root: Path = ROOT) -> list[str]:
    """The force knobs of the stage's roles (their defaults named ``*_force`` / ``model_fetch_update``)."""
    spec = _stage(stage)
    names = set()
    for role in spec.roles:
        defaults = _top_keys(root / "roles" / role / "defaults" / "main.yml")
        names.update(k for k in defaults if FORCE_RE.search(k))
    return sorted(names)


def spark_stage_input_names(stage: str) -> list[str]:
    return input_names(stage)


def spark_stage_after_record(probe: Mapping[str, Any] | None, stage: str,
                             record: Mapping[str, Any]) -> dict[str, Any]:
    """The probe as the stages after ``stage`` should see it: with the record just written."""
    out = dict(probe or {})
    stages = dict(out.get("stages") or {})
    entry = dict(record.get("entry") or {})
    entry["outputs_match"] = True
    entry["drift"] = []
    stages[stage] = entry
    out["stages"] = stages
    if record.get("salt"):
        out["salt"] = record["salt"]
    return out


class FilterModule:
    def filters(self):
        return {
            "spark_stage_gate": spark_stage_gate,
            "spark_stage_input_names": spark_stage_input_names,
            "spark_stage_after_record": spark_stage_after_record,
        }
