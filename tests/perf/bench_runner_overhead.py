#!/usr/bin/env python3
"""Runner overhead: measured decode tok/s vs the stand-in server's true rate.

Starts the stand-in server in a separate process (like vLLM on the Spark), runs ``bench.py run``
logic at concurrency 1 and 32, and prints measured / true for the median and the token-weighted
decode tok/s. "True" is the server's own per-request (n-1)/(t_last - t_first) from its emission
timestamps (GET /standin/truth); the nominal rate (tokens per step / step time) is printed too.
Goal: within 1 % at concurrency 1 and 2 % at concurrency 32.

    python tests/perf/bench_runner_overhead.py [--step-time 0.02] [--max-tokens 199]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from sparkllm.bench import client as bench_client  # noqa: E402
from sparkllm.bench import runner as bench_runner  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str) -> None:
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("stand-in server did not start")


def measure(url: str, concurrency: int, requests: int, max_tokens: int, tmp: Path) -> dict[str, float]:
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "chat_qa",
                                           "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                               for i in range(requests)))
    before = len(json.load(urllib.request.urlopen(url + "/standin/truth")))
    opts = bench_runner.RunOptions(base_url=url, model="standin-model", label="perf", out=tmp,
                                   prompts=prompts, warmup=2, concurrency=concurrency, progress=False,
                                   sampling=bench_client.Sampling(max_tokens=max_tokens))
    doc = bench_runner.execute_run(opts)
    truth = json.load(urllib.request.urlopen(url + "/standin/truth"))[before + 2 + 1:]  # probe + warm-up
    true_rates = [t["decode_tok_s"] for t in truth]
    true_tokens = sum(t["tokens"] - 1 for t in truth)
    true_time = sum(t["last_token_time"] - t["first_token_time"] for t in truth)
    s = doc["summary"]
    return {"measured_median": s["decode_tok_s"]["median"], "true_median": statistics.median(true_rates),
            "measured_weighted": s["token_weighted"]["decode_tok_s"],
            "true_weighted": true_tokens / true_time, "valid": doc["valid"], "n": len(truth),
            "problems": doc["problems"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--max-tokens", type=int, default=199)
    ap.add_argument("--tokens-per-step", type=int, default=3,
                    help="1 + accepted (K = this - 1, all accepted)")
    a = ap.parse_args()
    port = free_port()
    k = a.tokens_per_step - 1
    spec = ["--method", "mtp", "--k", str(k), "--pattern", str(k)] if k else ["--method", "none"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/fixtures/standin_server/server.py"),
                             "--host", "127.0.0.1", "--port", str(port), "--step-time", str(a.step_time),
                             "--prefill-time", "0.01", *spec], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url)
        nominal = a.tokens_per_step / a.step_time
        print(f"stand-in: {a.tokens_per_step} tokens per {a.step_time * 1000:.0f} ms step -> nominal "
              f"{nominal:.1f} tok/s per request")
        for conc, n in ((1, 8), (32, 64)):
            with tempfile.TemporaryDirectory() as tmp:
                r = measure(url, conc, n, a.max_tokens, Path(tmp))
            print(f"concurrency {conc:>2} ({r['n']} requests, run valid={r['valid']}): "
                  f"median measured/true = {r['measured_median'] / r['true_median']:.4f}, "
                  f"token-weighted measured/true = {r['measured_weighted'] / r['true_weighted']:.4f}, "
                  f"true/nominal = {r['true_median'] / nominal:.4f} {'; '.join(r['problems'])}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
