#!/usr/bin/env python3
"""Verify a safetensors checkpoint directory (standard library only).

Checks: every *.safetensors file is valid (header length <= 100 MB, JSON, contiguous offsets from 0,
byte lengths match dtype x shape, exact file size); model.safetensors.index.json and the files agree
both ways (every listed tensor is in the named file, every tensor of every listed file is listed,
files present but not listed are problems); metadata.total_size equals the sum of tensor bytes;
with --expect-mtp the mtp.* tensors are registered (all of model_extra_tensors.safetensors when
present); every F8_E4M3 weight has a *.weight_scale_inv partner whose shape is
(ceil(rows/b), ceil(cols/b)) for one block size b shared across the checkpoint; with
--expect-hybrid at least one FP8 weight exists and no FP8 tensor is under ".experts."; with
--expect-tool-tokens the tokenizer has the <tool_call> and </tool_call> tokens (without them vLLM's Qwen
tool parsers make every chat request fail with HTTP 500 when tool calling is on); with --fp8-source DIR
every FP8 weight's weight_scale_inv equals that of the FP8 checkpoint it was merged from (a scale 16x
off passes every other check, and a tiny model serves it with nearly the same text).

Against the inputs (a merged output's own index is rebuilt from what was written, so a shard missing from
an input is invisible without them): with --int4-source DIR the output holds every tensor that the INT4
checkpoint's index and its model_extra_tensors.safetensors name, plus only the scales of its FP8 weights
(the tensor count and the names); with --fp8-source DIR every FP8 weight is held by that checkpoint with
the same dtype and shape. The model role passes both (the checkpoints it merged from).

Exit codes: 0 valid, 1 invalid (one line per problem on stdout, or JSON with --json), 2 usage error
(bad arguments, DIR not a directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sparkllm.checkpoint.hybrid import verify_checkpoint
from sparkllm.cli import UsageError, doc_parser, run_main


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("verify_checkpoint.py", __doc__)
    p.add_argument("dir", type=Path, help="checkpoint directory")
    p.add_argument("--expect-mtp", action="store_true", help="require registered mtp.* tensors")
    p.add_argument("--expect-hybrid", action="store_true", help="require FP8 weights, none under .experts.")
    p.add_argument("--expect-tool-tokens", action="store_true",
                   help="require the <tool_call> and </tool_call> tokens vLLM's Qwen tool parsers need")
    p.add_argument("--fp8-source", type=Path, metavar="DIR",
                   help="FP8 checkpoint the hybrid came from: each weight_scale_inv must equal it "
                        "(default: unchecked)")
    p.add_argument("--int4-source", type=Path, metavar="DIR",
                   help="INT4 checkpoint the hybrid came from: the output must hold every tensor its index "
                        "names (default: unchecked)")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_main("verify_checkpoint", lambda: verify(a))


def verify(a: argparse.Namespace) -> int:
    if not a.dir.is_dir():
        raise UsageError(f"{a.dir}: not a directory; pass the checkpoint directory")
    if a.fp8_source is not None and not a.fp8_source.is_dir():
        raise UsageError(f"--fp8-source {a.fp8_source}: not a directory; pass the FP8 checkpoint the "
                         "hybrid was merged from")
    if a.int4_source is not None and not a.int4_source.is_dir():
        raise UsageError(f"--int4-source {a.int4_source}: not a directory; pass the INT4 checkpoint the "
                         "hybrid was merged from")
    r = verify_checkpoint(a.dir, expect_mtp=a.expect_mtp, expect_hybrid=a.expect_hybrid,
                          expect_tool_tokens=a.expect_tool_tokens, fp8_source=a.fp8_source,
                          int4_source=a.int4_source)
    if a.json:
        print(
            json.dumps(
                {
                    "ok": r.ok,
                    "problems": r.problems,
                    "files": r.files,
                    "tensors": r.tensors,
                    "fp8_weights": r.fp8_weights,
                    "mtp_tensors": r.mtp_tensors,
                    "block_size": r.block_size,
                }
            )
        )
    elif r.ok:
        print(
            f"{a.dir}: ok ({r.files} files, {r.tensors} tensors, {r.fp8_weights} FP8 weights, "
            f"block {r.block_size}, {r.mtp_tensors} mtp tensors)"
        )
    else:
        for line in r.problems:
            print(line)
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
