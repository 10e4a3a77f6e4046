#!/usr/bin/python
"""Ansible module: the per-stage records of site.yml on a host (probe them all, or record one).

The logic is scripts/sparkllm/stage/gate.py (shipped as ansible.module_utils.sparkllm.stage.gate), the one
implementation of the stage shortcut; this file is its Ansible interface."""

from __future__ import annotations

import os
import secrets
from datetime import UTC, datetime

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sparkllm.stage.gate import (
    FACT,
    OUTPUT_KINDS,
    observe,
    observed_digest,
    probe,
    read_fact,
    write_fact,
)

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
    data = read_fact(path)
    stages = data.get("stages") if isinstance(data.get("stages"), dict) else {}
    salt = data.get("salt") or p["salt"] or secrets.token_hex(16)

    def run(argv):
        return module.run_command(argv)

    if p["state"] == "probe":
        module.exit_json(changed=False, stages=probe(data, run, module.get_bin_path), salt=salt)

    unknown = sorted(set(p["outputs"]) - set(OUTPUT_KINDS))
    if unknown:
        module.fail_json(msg=f"spark_stage: unknown output kind(s) {', '.join(unknown)}; "
                             f"use {', '.join(OUTPUT_KINDS)}")
    seen = observe(p["outputs"], run, module.get_bin_path)
    entry = {"fingerprint": p["fingerprint"], "outputs": p["outputs"], "seen": seen}
    old = stages.get(p["stage"]) or {}
    changed = data.get("salt") != salt or {k: old.get(k) for k in entry} != entry
    result = {"fingerprint": p["fingerprint"], "observed": observed_digest(seen)}
    if changed and not module.check_mode:
        entry["recorded_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        stages[p["stage"]] = entry
        write_fact(path, {"salt": salt, "stages": stages})
    module.exit_json(changed=changed, salt=salt, entry=result)


if __name__ == "__main__":
    main()
