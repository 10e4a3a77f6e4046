"""Ansible filters of the stage shortcut; the logic is scripts/sparkllm/stage/gate.py (docs/layout.md).

- ``spark_stage_gate``: the decision (``current``, ``fingerprint``, ``reason``) for one stage.
- ``spark_stage_input_names``: the knobs a stage declares in playbooks/vars/stages.yml.
- ``spark_stage_after_record``: the probe with one stage's new record, for the stages after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

# scripts/ is the root of the toolkit's package: the host gets it as ansible.module_utils.sparkllm
# (ansible.cfg), pytest through its pythonpath; a controller plugin run by Ansible finds it here.
_SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if _SCRIPTS not in sys.path:
    sys.path.append(_SCRIPTS)

from sparkllm.stage.gate import after_record, gate, input_names  # noqa: E402


def spark_stage_gate(stage, hostvars, probe, force=False):
    return gate(stage, hostvars, probe, force)


def spark_stage_input_names(stage):
    return input_names(stage)


def spark_stage_after_record(probe, stage, record):
    return after_record(probe, stage, record)


class FilterModule:
    def filters(self):
        return {
            "spark_stage_gate": spark_stage_gate,
            "spark_stage_input_names": spark_stage_input_names,
            "spark_stage_after_record": spark_stage_after_record,
        }
