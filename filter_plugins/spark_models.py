"""The model catalogue (group_vars/all/models.yml): an entry's check, and the model x method check.

Pure Python (the argv filter beside it, which needs PyYAML); Ansible only needs the ``FilterModule`` at the
bottom. The entry format and its rules: docs/model-catalogue.md section 1.

- ``spark_model_entry_errors``: what is wrong with one entry (a bug of the catalogue or of an imported
  recipe, named by key).
- ``spark_model_errors``: the check playbooks/validate.yml runs before any host is touched: the selected
  ``model`` exists (else the known ones), its entry is sound, ``spec_method`` is one of the methods it
  supports (an unknown method is left to the method check), a drafter knob does not name another model's
  drafter, every size preflight's disk check needs is known, and its assembly is one the roles carry out.

Example (a playbook)::

    _errors: "{{ model | spark_model_errors(spark_model_catalogue, spec_method, spark_method_catalogue,
                 spark_vllm_variants, {'dflash': spec_dflash_drafter, 'eagle3': spec_eagle3_drafter}) }}"
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path

_PLUGINS = str(Path(__file__).resolve().parent)
if _PLUGINS not in sys.path:
    sys.path.append(_PLUGINS)

from spark_methods import SETTING_DEFAULTS, _check_extra_args  # noqa: E402

ENTRY_KEYS = {"description", "checkpoints", "assembly", "model_dir", "sizes", "serve", "server_env",
              "extra_args", "methods", "vllm_variant", "imported_from", "not_applied"}
REQUIRED_KEYS = ("description", "checkpoints", "assembly", "model_dir", "sizes", "serve", "methods",
                 "vllm_variant")
CHECKPOINT_KEYS = {"role", "repo", "revision", "mode"}
# The model's own serve settings: the knobs of group_vars/all/main.yml whose default is the selected entry's
# value (tests/unit/test_spark_models.py holds this equal to what main.yml reads). Every entry sets each one;
# null = unknown (an imported recipe that did not say), refused at deploy until filled in. Any other knob is
# the owner's (inventory), not the model's.
SERVE_KEYS = ("vllm_served_model_name", "vllm_max_model_len", "vllm_reasoning_parser",
              "vllm_tool_call_parser", "vllm_load_format", "vllm_lm_head_int8")
# hybrid_merge: the INT4 + FP8 merge and the MTP index patch (roles/model_hybrid); none: served as fetched.
ASSEMBLIES = ("hybrid_merge", "none")
# The pieces each assembly writes, as sizes.disk_bytes must name them (preflight's disk check reads them:
# roles/preflight/vars/main.yml; model_fetch the checkpoint's for a Hub fetch).
DISK_KEYS = {"hybrid_merge": {"int4", "fp8_extract", "fp8_full", "hybrid"}, "none": {"checkpoint"}}
FETCH_MODES = ("full", "extract")
# A method entry of a model: {} (the method catalogue's entry as is) or the drafter it uses with this model.
METHOD_KEYS = {"drafter", "drafter_revision"}
# The knob that names a method's drafter (methods.yml setting_overrides.model of eagle3 and dflash).
DRAFTER_KNOBS = {"eagle3": "spec_eagle3_drafter", "dflash": "spec_dflash_drafter"}
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_SERVER_ENV_RE = re.compile(r"[A-Z_][A-Z0-9_]*")


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_checkpoints(errors: list[str], where: str, checkpoints, assembly) -> None:
    if not isinstance(checkpoints, list) or not checkpoints:
        errors.append(f"{where}.checkpoints must be a non-empty list of {{role, repo, revision, mode}}")
        return
    roles = []
    for i, ckpt in enumerate(checkpoints):
        at = f"{where}.checkpoints[{i}]"
        if not isinstance(ckpt, Mapping):
            errors.append(f"{at} must be a mapping {{role, repo, revision, mode}}, got {ckpt!r}")
            continue
        missing = sorted(CHECKPOINT_KEYS - set(ckpt))
        unknown = sorted(set(ckpt) - CHECKPOINT_KEYS)
        if missing or unknown:
            errors.append(f"{at} has {'missing ' + ', '.join(missing) if missing else ''}"
                          f"{'; ' if missing and unknown else ''}"
                          f"{'unknown ' + ', '.join(unknown) if unknown else ''} keys; "
                          f"its keys are role, repo, revision, mode")
            continue
        roles.append(ckpt["role"])
        if not isinstance(ckpt["repo"], str) or not _REPO_RE.fullmatch(ckpt["repo"]):
            errors.append(f"{at}.repo={ckpt['repo']!r} is not a Hub repo id (owner/name)")
        revision = ckpt["revision"]
        if not (isinstance(revision, str) and (_COMMIT_RE.fullmatch(revision) or revision == "main")):
            errors.append(f"{at}.revision={revision!r} must be a commit (40 hex) or main (model_fetch "
                          f"resolves main to its commit at the first fetch and records it)")
        if ckpt["mode"] not in FETCH_MODES:
            errors.append(f"{at}.mode={ckpt['mode']!r} must be one of {', '.join(FETCH_MODES)}")
    if len(set(roles)) != len(roles):
        errors.append(f"{where}.checkpoints: the roles {roles} repeat; each piece has one role")
    plain_ok = len(checkpoints) == 1 and (not isinstance(checkpoints[0], Mapping)
                                          or checkpoints[0].get("mode") == "full")
    if assembly == "none" and not plain_ok:
        errors.append(f"{where}: assembly none serves one checkpoint as fetched; give exactly one "
                      f"checkpoint with mode full")
    if assembly == "hybrid_merge" and sorted(roles) != ["fp8", "int4"]:
        errors.append(f"{where}: assembly hybrid_merge merges an int4 and an fp8 checkpoint; its roles are "
                      f"{sorted(roles)}")


def _check_sizes(errors: list[str], where: str, sizes) -> None:
    if not isinstance(sizes, Mapping) or set(sizes) != {"disk_bytes", "memory_bytes"}:
        errors.append(f"{where}.sizes must be a mapping with disk_bytes and memory_bytes (null = unknown)")
        return
    disk = sizes["disk_bytes"]
    if not isinstance(disk, Mapping) or not disk:
        errors.append(f"{where}.sizes.disk_bytes must map each piece to its bytes (null = unknown)")
    else:
        for key, value in disk.items():
            if value is not None and not _is_size(value):
                errors.append(f"{where}.sizes.disk_bytes.{key}={value!r} must be a positive integer or null")
    memory = sizes["memory_bytes"]
    if memory is not None and not _is_size(memory):
        errors.append(f"{where}.sizes.memory_bytes={memory!r} must be a positive integer or null")


def _check_methods(errors: list[str], where: str, methods, method_catalogue) -> None:
    if not isinstance(methods, Mapping) or not methods:
        errors.append(f"{where}.methods must map at least one method to {{}} or its drafter")
        return
    for method, spec in methods.items():
        if not isinstance(method_catalogue, Mapping) or method not in method_catalogue:
            known = ", ".join(method_catalogue) if isinstance(method_catalogue, Mapping) else "(none)"
            errors.append(f"{where}.methods.{method} is not in the method catalogue ({known})")
            continue
        if not isinstance(spec, Mapping):
            errors.append(f"{where}.methods.{method} must be {{}} or a mapping of "
                          f"{', '.join(sorted(METHOD_KEYS))}")
            continue
        unknown = sorted(set(spec) - METHOD_KEYS)
        if unknown:
            errors.append(f"{where}.methods.{method} has unknown keys {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(METHOD_KEYS))}")
        if spec.get("drafter") is not None and method not in DRAFTER_KNOBS:
            errors.append(f"{where}.methods.{method} names a drafter, but {method} takes none "
                          f"(drafters: {', '.join(DRAFTER_KNOBS)})")


def spark_model_entry_errors(name: str, entry, method_catalogue: Mapping, variants: Mapping) -> list[str]:
    """What is wrong with catalogue entry ``name``; [] when nothing is."""
    where = f"spark_model_catalogue.{name}"
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        return [f"{where}: the name must be lower case letters, digits, . _ - (it is -e model=<name>)"]
    if not isinstance(entry, Mapping):
        return [f"{where} must be a mapping (docs/model-catalogue.md section 1), got {type(entry).__name__}"]
    errors: list[str] = []
    missing = [k for k in REQUIRED_KEYS if k not in entry]
    if missing:
        errors.append(f"{where} lacks {', '.join(missing)}")
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        errors.append(f"{where} has unknown keys {', '.join(unknown)}; "
                      f"known: {', '.join(sorted(ENTRY_KEYS))}")
    assembly = entry.get("assembly")
    if "assembly" in entry and assembly not in ASSEMBLIES:
        errors.append(f"{where}.assembly={assembly!r} must be one of {', '.join(ASSEMBLIES)}")
    if "checkpoints" in entry:
        _check_checkpoints(errors, where, entry["checkpoints"], assembly)
    model_dir = entry.get("model_dir")
    if "model_dir" in entry and not (isinstance(model_dir, str) and _NAME_RE.fullmatch(model_dir)):
        errors.append(f"{where}.model_dir={model_dir!r} must be a directory name (letters, digits, . _ -): "
                      f"the model's own directory under spark_model_root")
    if "sizes" in entry:
        _check_sizes(errors, where, entry["sizes"])
        disk = entry["sizes"].get("disk_bytes") if isinstance(entry["sizes"], Mapping) else None
        want = DISK_KEYS.get(assembly)
        if want and isinstance(disk, Mapping) and disk and set(disk) != want:
            errors.append(f"{where}.sizes.disk_bytes names {', '.join(sorted(disk))}; assembly {assembly} "
                          f"writes {', '.join(sorted(want))} (one size each, null = unknown)")
    serve = entry.get("serve")
    if "serve" in entry:
        if not isinstance(serve, Mapping):
            errors.append(f"{where}.serve must be a mapping of main.yml knobs to values")
        else:
            for knob in serve:
                if knob not in SETTING_DEFAULTS:
                    errors.append(f"{where}.serve.{knob} is not a serve knob of group_vars/all/main.yml")
                elif knob not in SERVE_KEYS:
                    errors.append(f"{where}.serve.{knob}: not a setting of the model (those are "
                                  f"{', '.join(SERVE_KEYS)}); set {knob} in the inventory")
            missing_serve = [k for k in SERVE_KEYS if k not in serve]
            if missing_serve:
                errors.append(f"{where}.serve lacks {', '.join(missing_serve)} (null = unknown)")
    env = entry.get("server_env") or {}
    env_ok = isinstance(env, Mapping) and all(isinstance(k, str) and _SERVER_ENV_RE.fullmatch(k) for k in env)
    if not env_ok:
        errors.append(f"{where}.server_env must map upper-case variable names to values")
    extra: list[str] = []
    _check_extra_args(extra, entry.get("extra_args", []))
    errors += [f"{where}.extra_args: {e.replace('vllm_serve_extra_args', 'extra_args')}" for e in extra]
    if "methods" in entry:
        _check_methods(errors, where, entry["methods"], method_catalogue)
    variant = entry.get("vllm_variant")
    if "vllm_variant" in entry and (not isinstance(variants, Mapping) or variant not in variants):
        known = ", ".join(variants) if isinstance(variants, Mapping) else "(none)"
        errors.append(f"{where}.vllm_variant={variant!r} is not a build variant of methods.yml ({known})")
    return errors


def _drafter_errors(name: str, entry: Mapping, method: str, catalogue: Mapping,
                    drafters: Mapping) -> list[str]:
    knob = DRAFTER_KNOBS.get(method)
    value = (drafters or {}).get(method) if knob else None
    if not value:
        return []
    mine = ((entry.get("methods") or {}).get(method) or {}).get("drafter")
    if value == mine:
        return []
    for other, other_entry in catalogue.items():
        if other == name or not isinstance(other_entry, Mapping):
            continue
        theirs = ((other_entry.get("methods") or {}).get(method) or {}).get("drafter")
        if theirs and theirs == value:
            fix = f"set {knob} to {mine}" if mine else f"set {knob} to a drafter trained for {name}"
            return [f"{knob}={value!r} is the {method} drafter of {other}, not of model={name}; {fix}"]
    return []


def spark_model_errors(model, catalogue: Mapping, method, method_catalogue: Mapping, variants: Mapping,
                       drafters: Mapping | None = None) -> list[str]:
    """Every reason the selected ``model`` cannot be deployed with ``method``; [] when it can.
    ``drafters``: method -> the value of its drafter knob (spec_dflash_drafter, spec_eagle3_drafter)."""
    if not isinstance(catalogue, Mapping) or not catalogue:
        return ["spark_model_catalogue is empty or not a mapping; it lives in group_vars/all/models.yml"]
    if not isinstance(model, str) or model not in catalogue:
        return [f"model={model!r} is not in the model catalogue; set -e model= to one of: "
                f"{', '.join(catalogue)} (group_vars/all/models.yml)"]
    entry = catalogue[model]
    errors = spark_model_entry_errors(model, entry, method_catalogue, variants)
    if errors:
        return errors
    methods = entry["methods"]
    if method not in methods and isinstance(method_catalogue, Mapping) and method in method_catalogue:
        errors.append(f"spec_method={method!r} is not supported by model={model}; it supports: "
                      f"{', '.join(methods)}")
    elif method in methods:
        errors += _drafter_errors(model, entry, method, catalogue, drafters or {})
    unset = [k for k in SERVE_KEYS if entry["serve"].get(k) is None]
    if unset:
        errors.append(f"model={model}: serve.{', serve.'.join(unset)} unknown (null); fill them in for this "
                      f"checkpoint (its config.json and chat template) in its catalogue entry")
    unknown = [k for k, v in entry["sizes"]["disk_bytes"].items() if v is None]
    if unknown:
        errors.append(f"model={model}: its size on disk is unknown (sizes.disk_bytes "
                      f"{', '.join(unknown)} null), and preflight's disk check needs it; fill it in from the "
                      f"Hub's file sizes in group_vars/all/models.yml")
    return errors


class FilterModule:
    """Ansible filters: spark_model_entry_errors, spark_model_errors."""

    def filters(self):
        return {
            "spark_model_entry_errors": spark_model_entry_errors,
            "spark_model_errors": spark_model_errors,
        }
