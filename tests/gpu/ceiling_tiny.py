#!/usr/bin/env python3
"""Real GPU: the physical ceiling ``bench.py run --model-dir`` stores, beside a measured decode.

    python3 tests/gpu/ceiling_tiny.py --out DIR [--work DIR] [--bandwidth-gbs 4800] [--start-timeout 360]

On a host where ``import vllm`` works (as tests/gpu/e2e.py: it reuses its pipeline and server), it
builds the tiny Qwen3.5-MoE pair (tests/gpu/tiny_pair.py), merges it with scripts/hybrid_merge.py,
serves the hybrid as the baseline method (patched vLLM, the argv ``spark_serve_argv`` renders), runs
``scripts/bench.py run --model-dir HYBRID --bandwidth-gbs B`` against it and compares the ceiling the
run stored (bytes read per generated token from the hybrid's safetensors headers / B) with the
measured median decode tok/s.

Read the figure for what it is: **a tiny model is launch-bound, not bandwidth-bound.** Its weights are a
few MB, so a decode step is kernel launches and host work, far below the bandwidth ceiling (and the
weights may sit in the GPU's L2 cache). The run checks only that the ceiling is stored with every byte
class, and that the measured figure does not exceed it (a ceiling below a measurement means bytes were
miscounted); the measured/ceiling fraction is recorded, not judged. The default bandwidth is the H200's
nominal 4.8 TB/s (NVIDIA's H200 specification); pass a measured figure to compare with that instead.

Writes DIR/summary.json and prints ``CEILING SUMMARY {...}``; exit 0 when the checks passed, 1 when one
failed, 2 usage (no vLLM, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "filter_plugins")]

H200_BANDWIDTH_GBS = 4800.0  # NVIDIA H200 specification: 4.8 TB/s HBM3e, nominal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ceiling_tiny.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results: server log, run JSON, summary.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-ceiling"),
                    help="scratch directory for the models and the patched vLLM (default: %(default)s)")
    ap.add_argument("--bandwidth-gbs", type=float, default=H200_BANDWIDTH_GBS,
                    help="memory bandwidth in GB/s (default: %(default)s, the H200's nominal figure)")
    ap.add_argument("--start-timeout", type=float, default=360, help="seconds for the server (default: 360)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: 128)")
    a = ap.parse_args(argv)
    from tests.gpu import e2e  # the GPU pipeline: imports vllm's host facts lazily, numpy for the tiny pair

    a.out.mkdir(parents=True, exist_ok=True)
    rec = e2e.Record(a.out, a.work, figures={})
    host = rec.host("ceiling_tiny.py")
    if host is None:
        return 2
    models = e2e.build_models(a.work)
    _, patched_pp = rec.patched(a.work, host)
    hybrid = models["dirs"]["hybrid"]
    server = e2e.Server("ceiling-base", "baseline", hybrid, 8191, patched_pp, a.out)
    server.start()
    try:
        deadline = time.monotonic() + a.start_timeout
        while server.poll() == "starting" and time.monotonic() < deadline:
            time.sleep(2)
        rec.check("server up", server.poll() == "up", {"exit_code": server.exit_code})
        if server.poll() == "up":
            runs = a.out / "runs"
            cmd = [sys.executable, str(ROOT / "scripts/bench.py"), "run", "--base-url", server.url,
                   "--model", "tiny", "--label", "ceiling-base", "--out", str(runs), "--warmup", "1",
                   "--max-tokens", str(a.max_tokens), "--quiet", "--model-dir", hybrid,
                   "--bandwidth-gbs", str(a.bandwidth_gbs)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            rec.check("bench.py run exits 0", r.returncode == 0, r.stderr[-2000:])
            docs = [json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))]
            ceiling = (docs[-1].get("ceiling") if docs else None) or {}
            measured = docs[-1]["summary"]["decode_tok_s"]["median"] if docs else None
            rec.check("the run stored the ceiling with every byte class",
                      bool(ceiling.get("ceiling_tok_s")) and all(
                          ceiling["bytes"].get(c) for c in ("routed_experts", "shared_experts", "attention",
                                                           "linear_attention", "lm_head", "linear_state")),
                      ceiling.get("bytes"))
            rec.check("measured decode does not exceed the ceiling",
                      measured is not None and measured <= (ceiling.get("ceiling_tok_s") or 0),
                      {"measured": measured, "ceiling": ceiling.get("ceiling_tok_s")})
            rec.summary["figures"] = {
                "bandwidth_gbs": a.bandwidth_gbs, "bytes_per_token": ceiling.get("bytes_per_token"),
                "context_tokens": ceiling.get("context_tokens"),
                "ceiling_tok_s": ceiling.get("ceiling_tok_s"),
                "measured_decode_tok_s_median": measured,
                "measured_over_ceiling": measured / ceiling["ceiling_tok_s"]
                if measured and ceiling.get("ceiling_tok_s") else None,
                "note": "tiny model: launch-bound, not bandwidth-bound; the fraction is recorded, not judged"}
    finally:
        server.stop()
    rec.save()
    print("CEILING SUMMARY " + json.dumps(rec.summary, default=str))
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
