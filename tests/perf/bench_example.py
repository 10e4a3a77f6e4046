#!/usr/bin/env python3
"""Regenerate the README's example report (docs/bench-example/) from stand-in runs with known behaviour.

Every figure in it comes from the stand-in server (tests/fixtures/standin_server), NOT from a Spark:

- baseline: one token per 10 ms step; mtp-k2: conditional acceptance 0.8/0.6 (seeded); dflash-k8:
  acceptance 0.95 at every position but garbled words (fast and wrong: flagged, never recommended);
- a step lasts 10 ms x (1 + s x (running - 1)), s = 0.15 (baseline, mtp) or 0.30 (dflash);
- prefill 20 us per prompt token; at most 4 requests served at once, the others queue (vLLM's
  max_num_seqs 4 of the one-user profile), so above capacity TTFT grows and goodput falls.

Runs: concurrency 1,2,4 at depth 0, concurrency 1 at depth 4096, request rates 2,8,16 req/s (24
Poisson arrivals, seed 0, goodput ttft=500ms,tpot=30ms); two baseline repetitions everywhere (the
outputs' noise floor). About three minutes on a 2-core machine.

    .venv/bin/python tests/perf/bench_example.py docs/bench-example
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]  # sparkllm, tests.*

import bench  # noqa: E402
from sparkllm.bench import report as bench_report  # noqa: E402

from tests.fixtures.standin_server import Config, StandinServer  # noqa: E402

COMMON = {"model": "qwen3.5-122b", "step_time": 0.01, "prefill_per_token": 2e-5, "max_running": 4,
          "tokens_per_word": 1.3}
METHODS = {
    "baseline": Config(**COMMON, concurrency_slowdown=0.15),
    "mtp-k2": Config(**COMMON, concurrency_slowdown=0.15, spec=True, method="mtp", k=2, accept=(0.8, 0.6),
                     seed=1),
    "dflash-k8": Config(**COMMON, concurrency_slowdown=0.30, spec=True, method="dflash", k=8,
                        accept=(0.95,), seed=2, garble=True),
}


NOTE = ("> Example made by `tests/perf/bench_example.py` from runs against the stand-in server "
        "(tests/fixtures/standin_server) with known behaviour: every figure below is the stand-in's, "
        "not a DGX Spark's.\n\n")


def prompts(path: Path) -> Path:
    cats = {"code": "Write a function that", "chat_qa": "Explain why", "math": "Compute"}
    with path.open("w") as fh:
        for cat, stem in cats.items():
            for i in range(2):
                fh.write(json.dumps({"id": f"{cat}-{i}", "category": cat,
                                     "messages": [{"role": "user", "content": f"{stem} item {i}"}]}) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="report directory (docs/bench-example)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-example-") as tmp:
        store, p = Path(tmp) / "store", prompts(Path(tmp) / "p.jsonl")
        loads = [["--concurrency", "1,2,4"], ["--concurrency", "1", "--depth", "4096"],
                 ["--request-rate", "2,8,16", "--num-requests", "24", "--goodput", "ttft=500ms,tpot=30ms"]]
        for rep in (1, 2):
            for label, cfg in METHODS.items():
                if rep == 2 and label != "baseline":
                    continue
                with StandinServer(cfg) as srv:
                    for load in loads:
                        rc = bench.main(["run", "--base-url", srv.base_url, "--model", cfg.model,
                                         "--label", label, "--out", str(store), "--prompts", str(p),
                                         "--max-tokens", "32", "--warmup", "1", "--quiet",
                                         "--meta-json", json.dumps({"repetition": rep}), *load])
                        if rc != 0:
                            print(f"bench_example: {label} {load} exited {rc}", file=sys.stderr)
                            return 1
        out = Path(a.out)
        path, _ = bench_report.make_report(store, out)
    (out / ".sparkllm-owner.json").unlink(missing_ok=True)  # a committed copy, not a tool's directory
    path.write_text(NOTE + path.read_text(encoding="utf-8"), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
