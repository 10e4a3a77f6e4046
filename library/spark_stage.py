#!/usr/bin/python
"""Ansible module: the per-stage records of site.yml on a host (probe them all, or record one)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from datetime import UTC, datetime

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: spark_stage
short_description: Probe or record which stages of site.yml completed, with their inputs and outputs
description:
  - Keeps one local fact, C(spark_stage.fact) (mode 0600), holding for each stage the fingerprint of
    its inputs (computed on the controller by the C(spark_stage_gate) filter), the outputs it declared
    and what those outputs were when it completed.
  - O(state=probe) reads every record and observes the recorded outputs again (image IDs, directory
    listings, file checksums, unit states, the boot ID) in this one call; it reports per stage whether
    they still match, and what drifted. It changes nothing.
  - O(state=record) observes the outputs of O(stage) and writes its record atomically (temporary file and
    rename); unchanged records are not rewritten.
  - Outputs: C(files) (sha256 of each, absent = missing), C(dirs) (every file's relative path, size and
    mtime), C(images) (Docker image IDs), C(units) (systemd active state), C(boot) (the kernel boot ID:
    a reboot makes a hardware check run again).
options:
  state:
    description: C(probe) all stages or C(record) one.
    type: str
    choices: [probe, record]
    default: probe
  facts_dir:
    description: Local facts directory.
    type: path
    default: /etc/ansible/facts.d
  stage:
    description: Stage to record (O(state=record)).
    type: str
  fingerprint:
    description: Fingerprint of the stage's inputs (O(state=record)).
    type: str
  salt:
    description: Per-host salt the controller used for secret inputs; stored on the first record.
    type: str
    default: ""
  outputs:
    description: What the stage produced (O(state=record)).
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
author:
  - spark-llm-toolkit
"""

EXAMPLES = r"""
- name: Probe every stage's record
  spark_stage:
  register: spark_stage_probe

- name: Record the build stage
  spark_stage:
    state: record
    stage: build
    fingerprint: "{{ _gate.fingerprint }}"
    salt: "{{ spark_stage_probe.salt }}"
    outputs: {images: ["vllm-sm121:0.19.1"]}
"""

RETURN = r"""
stages:
  description: Per recorded stage, its fingerprint, whether the outputs still match, what drifted.
  returned: state=probe
  type: dict
salt:
  description: The per-host salt (a new random one when the host has no record yet).
  returned: always
  type: str
entry:
  description: The record written for O(stage).
  returned: state=record
  type: dict
"""

FACT = "spark_stage.fact"
OUTPUT_KINDS = ("files", "dirs", "images", "units", "boot")
HASH_LIMIT = 64 * 1024 * 1024  # larger files are observed by size and mtime, not read


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _file(path: str):
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


def _dir(path: str):
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


def _image(module: AnsibleModule, docker: str | None, name: str):
    if not docker:
        return None
    rc, out, _ = module.run_command([docker, "image", "inspect", "--format", "{{.Id}}", name])
    return out.strip() if rc == 0 and out.strip() else None


def _unit(module: AnsibleModule, systemctl: str | None, name: str):
    if not systemctl:
        return None
    _, out, _ = module.run_command([systemctl, "is-active", name])
    return out.strip() or "unknown"


def _boot():
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def observe(module: AnsibleModule, outputs: dict) -> dict:
    docker = module.get_bin_path("docker") if outputs.get("images") else None
    systemctl = module.get_bin_path("systemctl") if outputs.get("units") else None
    seen: dict = {}
    for path in outputs.get("files") or []:
        seen[f"file {path}"] = _file(path)
    for path in outputs.get("dirs") or []:
        seen[f"dir {path}"] = _dir(path)
    for name in outputs.get("images") or []:
        seen[f"image {name}"] = _image(module, docker, name)
    for name in outputs.get("units") or []:
        seen[f"unit {name}"] = _unit(module, systemctl, name)
    if outputs.get("boot"):
        seen["boot"] = _boot()
    return seen


def _digest(seen: dict) -> str:
    return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()


def _drift(before: dict, now: dict) -> list:
    out = []
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            was, is_ = before.get(key), now.get(key)
            out.append(f"{key}: {'missing' if is_ is None else 'changed'}"
                       + ("" if was is not None else " (was missing)"))
    return out


def _write(path: str, data: dict) -> None:
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


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["probe", "record"], default="probe"),
            facts_dir=dict(type="path", default="/etc/ansible/facts.d"),
            stage=dict(type="str"),
            fingerprint=dict(type="str"),
            salt=dict(type="str", default="", no_log=False),
            outputs=dict(type="dict", default={}),
        ),
        required_if=[("state", "record", ("stage", "fingerprint"))],
        supports_check_mode=True,
    )
    p = module.params
    path = os.path.join(p["facts_dir"], FACT)
    data = _read(path)
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    salt = data.get("salt") or p["salt"] or secrets.token_hex(16)

    if p["state"] == "probe":
        report = {}
        for name, rec in stages.items():
            if not isinstance(rec, dict):
                continue
            now = observe(module, rec.get("outputs") or {})
            before = rec.get("seen") or {}
            report[name] = {"fingerprint": rec.get("fingerprint", ""), "observed": _digest(now),
                            "outputs_match": now == before, "drift": _drift(before, now)}
        module.exit_json(changed=False, stages=report, salt=salt)

    unknown = sorted(set(p["outputs"]) - set(OUTPUT_KINDS))
    if unknown:
        module.fail_json(msg=f"spark_stage: unknown output kind(s) {', '.join(unknown)}; "
                             f"use {', '.join(OUTPUT_KINDS)}")
    seen = observe(module, p["outputs"])
    entry = {"fingerprint": p["fingerprint"], "outputs": p["outputs"], "seen": seen}
    old = stages.get(p["stage"]) or {}
    changed = data.get("salt") != salt or {k: old.get(k) for k in entry} != entry
    result = {"fingerprint": p["fingerprint"], "observed": _digest(seen)}
    if changed and not module.check_mode:
        entry["recorded_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        stages[p["stage"]] = entry
        _write(path, {"salt": salt, "stages": stages})
    module.exit_json(changed=changed, salt=salt, entry=result)


if __name__ == "__main__":
    main()
