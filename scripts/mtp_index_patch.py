#!/usr/bin/env python3
"""Register the MTP head (mtp.* tensors) in a checkpoint's model.safetensors.index.json.

The names come from the header of SOURCE/model_extra_tensors.safetensors itself (never from the
source index). The file is hard-linked (same filesystem) or copied into TARGET when absent or
different (temp file + rename); every name is mapped to it in TARGET's index, metadata.total_size is
recomputed from the headers of the listed files, and the index is rewritten atomically. Idempotent:
a second run reports changed=false. --check reports what would change and writes nothing.

JSON result (--json): {"changed", "added", "copied", "linked", "total_size_before",
"total_size_after", "entries_before", "entries_after", "mtp_tensors"}.

TARGET must be a directory made by this toolkit (the output of hybrid_merge.py, a fetched copy) and not
SOURCE itself: a directory someone else made is refused, before anything is written, when the patch
would change it.

Exit codes: 0 ok (also with --check), 1 invalid input (e.g. missing extra file), 2 usage error
(bad arguments, a target the patch may not write).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sparkllm.checkpoint.hybrid import EXTRA_FILE, CheckpointError, apply_mtp_patch, plan_mtp_patch
from sparkllm.checkpoint.safetensors_io import SafetensorsError
from sparkllm.cli import doc_parser, run_main
from sparkllm.outdir import OutputRefused


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("mtp_index_patch.py", __doc__)
    p.add_argument(
        "--source", required=True, type=Path, help=f"INT4 checkpoint directory holding {EXTRA_FILE}"
    )
    p.add_argument("--target", required=True, type=Path, help="model directory whose index is patched")
    p.add_argument("--extra-file", default=EXTRA_FILE, help="MTP file name")
    p.add_argument("--check", action="store_true", help="report what would change, write nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_main("mtp_index_patch", lambda: patch(a), usage=(OutputRefused,),
                    failed=(CheckpointError, SafetensorsError, OSError))


def patch(a: argparse.Namespace) -> int:
    if a.check:
        result, _ = plan_mtp_patch(a.source, a.target, a.extra_file)
    else:
        result = apply_mtp_patch(a.source, a.target, a.extra_file)
    if a.json:
        print(json.dumps(result.as_dict()))
    else:
        verb = "would change" if a.check else "changed"
        state = (
            f"{verb}: added {result.added} names, copied={result.copied}" if result.changed else "up to date"
        )
        print(f"{a.target}: {state}; total_size {result.total_size_before} -> {result.total_size_after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
