#!/usr/bin/python
"""Ansible module: register the MTP head tensors in a checkpoint index."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: mtp_index_patch
short_description: Register the mtp.* tensors of model_extra_tensors.safetensors in a model index
description:
  - Reads the tensor names from the header of O(source)/O(extra_file) (not from the source index).
  - Hard-links (same filesystem) or copies the extra file into O(target) when it is absent or
    differs, using a temporary file and a rename.
  - Maps every C(mtp.*) name to that file in O(target)/model.safetensors.index.json, recomputes
    C(metadata.total_size) from the headers of the listed files and rewrites the index atomically.
  - Idempotent; supports check mode and diff mode (weight_map entry count and total_size).
  - Uses the same logic as C(scripts/mtp_index_patch.py).
  - O(target) must be a directory made by this toolkit (a C(hybrid_merge.py) output, a fetched copy) other
    than O(source); a directory someone else made is refused, before anything is written, when the patch
    would change it.
version_added: "0.1.0"
options:
  source:
    description: INT4 checkpoint directory that holds the MTP extra file.
    type: path
    required: true
  target:
    description: Model directory whose C(model.safetensors.index.json) is patched.
    type: path
    required: true
  extra_file:
    description: File name of the MTP extra tensors.
    type: str
    default: model_extra_tensors.safetensors
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
author:
  - spark-llm-toolkit
"""

EXAMPLES = r"""
- name: Register the MTP head in the hybrid checkpoint index
  mtp_index_patch:
    source: /models/int4
    target: /models/hybrid
"""

RETURN = r"""
added:
  description: Number of mtp.* names newly registered.
  returned: always
  type: int
  sample: 785
copied:
  description: Whether the extra file was (or would be) placed into the target.
  returned: always
  type: bool
linked:
  description: Whether the extra file was placed as a hard link rather than a copy.
  returned: always
  type: bool
total_size_before:
  description: metadata.total_size of the index before the patch (null if absent).
  returned: always
  type: int
total_size_after:
  description: metadata.total_size after the patch.
  returned: always
  type: int
entries_before:
  description: Number of weight_map entries before the patch.
  returned: always
  type: int
entries_after:
  description: Number of weight_map entries after the patch.
  returned: always
  type: int
mtp_tensors:
  description: Number of mtp.* tensors in the extra file.
  returned: always
  type: int
"""

from pathlib import Path  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.sparkllm.checkpoint.hybrid import (  # noqa: E402
    EXTRA_FILE,
    CheckpointError,
    apply_mtp_patch,
    plan_mtp_patch,
)
from ansible.module_utils.sparkllm.checkpoint.safetensors_io import SafetensorsError  # noqa: E402
from ansible.module_utils.sparkllm.outdir import OutputRefused  # noqa: E402


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "source": {"type": "path", "required": True},
            "target": {"type": "path", "required": True},
            "extra_file": {"type": "str", "default": EXTRA_FILE},
        },
        supports_check_mode=True,
    )
    source = Path(module.params["source"])
    target = Path(module.params["target"])
    extra = module.params["extra_file"]
    try:
        if module.check_mode:
            result, _ = plan_mtp_patch(source, target, extra)
        else:
            result = apply_mtp_patch(source, target, extra)
    except (CheckpointError, SafetensorsError, OutputRefused, OSError) as exc:
        module.fail_json(msg=str(exc))
    out = result.as_dict()
    if module._diff and result.changed:
        out["diff"] = result.diff()
    module.exit_json(**out)


if __name__ == "__main__":
    main()
