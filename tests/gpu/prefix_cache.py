#!/usr/bin/env python3
"""Real GPU: prefix caching on our tiny Qwen3.5 hybrid gives the same tokens as without it, and is used.

    python3 tests/gpu/prefix_cache.py --out DIR [--work DIR] [--budget S] [--methods baseline,ngram,mtp]
                                      [--prefix-tokens N] [--max-tokens N]

On a host where ``import vllm`` works (tests/gpu/gpu_host.sh; 0.26.0 after prepare_v026.sh), it builds
our hybrid with our pipeline (e2e.build_models: DeltaNet layers 0-2, full attention in layer 3, like
Qwen3.5-122B-A10B), applies our patch series to a copy of vLLM (e2e.patched_vllm) and starts, at once,
two servers per method with the argv ``spark_serve_argv`` renders (the host's flags through the owners'
knobs, e2e.HOST_SETTINGS):

  METHOD-off  vllm_enable_prefix_caching=false   (--no-enable-prefix-caching)
  METHOD-on   the catalogue's choice when it turns caching on (baseline: --enable-prefix-caching
              --mamba-cache-mode align), else forced with vllm_enable_prefix_caching=true

Each server gets the same two-turn conversation, greedy, streamed with top-1 logprobs: turn 1 is a
--prefix-tokens prompt (one byte per token: the tiny tokenizer has no merges), turn 2 is turn 1's
prompt + its answer + a new question, so turn 2 shares a long prefix with what the server has seen.
Checks:
  - every server serves;
  - METHOD-on's tokens of both turns equal METHOD-off's, top-1 logprobs within LOGPROB_TOL;
  - the comparison has power: on METHOD-off, the same conversation with the first half of the prompt
    replaced moves some top-1 logprob by more than LOGPROB_TOL or a token (the DeltaNet state carries
    the prefix: a reused wrong state would show);
  - METHOD-on: vllm:prefix_cache_hits grows during turn 2 (the cache was used); METHOD-off: it does not.
Reported per server: turn 2's time to first token (a cached prefix against a full prefill), the
prefix-cache queries and hits of turn 2 (from /metrics), the attention block size and mamba cache
mode vLLM logged, and the argv. Writes DIR/summary.json and DIR/vllm-LABEL.log; prints the summary's
checks. Budget: one cold start of the servers (~5 min on an H200) plus seconds of requests: under
10 minutes. Exit 0 every check passed, 1 one failed, 2 usage or no vLLM/GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from tests.gpu import e2e

log = e2e.logger("prefix_cache")

METHODS = ("baseline", "ngram", "mtp")  # those the tiny hybrid serves without a separate drafter
LOGPROB_TOL = e2e.LOGPROB_TOL
PREFIX_METRICS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")  # counters (0.19.1 and 0.26.0
# vllm/v1/metrics/loggers.py), exposed with the _total suffix
BLOCK_LINE = re.compile(r"Setting attention block size to (\d+) tokens")
MODE_LINE = re.compile(r"Mamba cache mode is set to '(\w+)'|Prefix caching in Mamba cache '(\w+)' mode")
QUESTION = "\nQ: and what follows after that? A:"


def conversation_prompt(n: int, seed: int = 7) -> str:
    """n printable ASCII bytes, deterministic (one token each for the tiny byte-level tokenizer)."""
    rng = random.Random(seed)
    words = ["spark", "qwen", "delta", "net", "cache", "block", "token", "prefix", "state", "turn"]
    out = ""
    while len(out) < n:
        out += rng.choice(words) + (". " if rng.random() < 0.1 else " ")
    return out[:n]


def stream_completion(url: str, prompt: str, max_tokens: int, timeout: float = 120) -> dict:
    """A greedy streamed completion: its text, tokens, top-1 logprobs and time to the first token."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft, text, tokens, logprobs = None, "", [], []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                lp = choice.get("logprobs") or {}
                if lp.get("tokens"):
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    tokens += lp["tokens"]
                    logprobs += lp["token_logprobs"]
                text += choice.get("text") or ""
    return {"text": text, "tokens": tokens, "logprobs": logprobs,
            "ttft_s": None if ttft is None else round(ttft, 4), "seconds": round(time.monotonic() - t0, 4)}


def prefix_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(PREFIX_METRICS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^(vllm:prefix_cache_(?:queries|hits))_total(?:\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] += float(m.group(2))
    return out


def conversation(url: str, prefix_tokens: int, max_tokens: int, other_head: bool = False) -> dict:
    """Turn 1, then turn 2 sharing turn 1's prompt and answer; the prefix counters' deltas of turn 2.
    ``other_head``: the prompt's first half replaced by other text (the control a wrong state would be)."""
    p1 = conversation_prompt(prefix_tokens)
    if other_head:
        half = prefix_tokens // 2
        p1 = conversation_prompt(half, seed=8) + p1[half:]
    t1 = stream_completion(url, p1, max_tokens)
    before = prefix_counters(url)
    t2 = stream_completion(url, p1 + t1["text"] + QUESTION, max_tokens)
    after = prefix_counters(url)
    return {"turn1": t1, "turn2": t2,
            "turn2_prefix_cache": {k.split(":")[1]: after[k] - before[k] for k in PREFIX_METRICS}}


def same_tokens(ref: dict, got: dict) -> dict:
    """Equal tokens over both turns, and the largest top-1 logprob difference where they agree."""
    diff, equal = 0.0, True
    for turn in ("turn1", "turn2"):
        a, b = ref[turn], got[turn]
        equal &= a["tokens"] == b["tokens"]
        for x, y in zip(a["logprobs"], b["logprobs"], strict=False):
            if x is not None and y is not None:
                diff = max(diff, abs(x - y))
    return {"equal": equal, "max_logprob_diff": round(diff, 5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prefix_cache.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results: summary.json and the server logs")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-prefix"),
                    help="scratch directory: models, the patched vLLM (default /tmp/sparkllm-gpu-prefix)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--methods", default="baseline",
                    help=f"comma list from {', '.join(METHODS)} (default baseline: the catalogue's one "
                         "method with prefix caching on; the others are forced on to gather evidence)")
    ap.add_argument("--prefix-tokens", type=int, default=1200,
                    help="turn 1's prompt length in tokens (default 1200; the tiny model serves 2048)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    a = ap.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    if not methods or any(m not in METHODS for m in methods):
        print(f"prefix_cache.py: --methods takes names from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if not 64 <= a.prefix_tokens <= 2048 - 2 * a.max_tokens - len(QUESTION) - 1 or a.max_tokens < 1:
        print("prefix_cache.py: --prefix-tokens must be >= 64 and leave room for two answers and the "
              "question in the tiny model's 2048 tokens; --max-tokens >= 1", file=sys.stderr)
        return 2
    catalogue = e2e.load_catalogue()
    config = {"methods": methods, "prefix_tokens": a.prefix_tokens, "max_tokens": a.max_tokens,
              "logprob_tol": LOGPROB_TOL}
    rec = e2e.Record(a.out, a.work, log_fn=log, config=config)
    host = rec.host("prefix_cache.py")
    if host is None:
        return 2
    models = e2e.build_models(a.work)
    _, pythonpath = rec.patched(a.work, host)
    servers: dict[str, e2e.Server] = {}
    for i, m in enumerate(methods):
        on = {} if catalogue[m]["prefix_caching"]["default"] else {"vllm_enable_prefix_caching": True}
        for j, (label, extra) in enumerate(((f"{m}-off", {"vllm_enable_prefix_caching": False}),
                                            (f"{m}-on", on))):
            servers[label] = e2e.Server(label, m, models["dirs"]["hybrid"], 8301 + 2 * i + j, pythonpath,
                                        a.out, extra_settings=extra)
    try:
        for s in servers.values():
            s.start()
        log("started " + ", ".join(f"{s.label}:{s.port}" for s in servers.values()))
        deadline = rec.t0 + a.budget - 60
        while time.monotonic() < deadline and any(s.poll() == "starting" for s in servers.values()):
            time.sleep(2)
        results = {}
        for label, s in servers.items():
            state = s.poll()
            logtext = s.log_text()
            modes = [x or y for x, y in MODE_LINE.findall(logtext)]
            rec.summary.setdefault("servers", {})[label] = {
                "state": state, "ready_s": None if s.healthy_after is None else round(s.healthy_after, 1),
                "argv": s.argv, "block_size": [int(b) for b in BLOCK_LINE.findall(logtext)][-1:],
                "mamba_cache_mode": modes[-1:]}
            rec.check(f"{label} serves", state == "up", rec.summary["servers"][label])
            if state == "up":
                results[label] = conversation(s.url, a.prefix_tokens, a.max_tokens)
        for m in methods:
            off, on = results.get(f"{m}-off"), results.get(f"{m}-on")
            if off is None or on is None:
                continue
            rec.summary.setdefault("figures", {})[m] = {
                label: {"turn2_ttft_s": r["turn2"]["ttft_s"], "turn2_prefix_cache": r["turn2_prefix_cache"]}
                for label, r in ((f"{m}-off", off), (f"{m}-on", on))}
            same = same_tokens(off, on)
            rec.check(f"{m}: the cache gives the same greedy tokens",
                      same["equal"] and same["max_logprob_diff"] <= LOGPROB_TOL, same)
            control = conversation(servers[f"{m}-off"].url, a.prefix_tokens, a.max_tokens, other_head=True)
            power = same_tokens(off, control)
            rec.check(f"{m}: a changed prefix moves the logprobs (the comparison has power)",
                      not power["equal"] or power["max_logprob_diff"] > LOGPROB_TOL, power)
            hits_on, hits_off = on["turn2_prefix_cache"], off["turn2_prefix_cache"]
            rec.check(f"{m}-on: turn 2 hits the prefix cache", hits_on["prefix_cache_hits"] > 0, hits_on)
            rec.check(f"{m}-off: no prefix-cache hits", hits_off["prefix_cache_hits"] == 0, hits_off)
        (a.out / "conversations.json").write_text(json.dumps(results, indent=1))
    except (OSError, ValueError, KeyError) as e:
        rec.check("requests", False, f"{type(e).__name__}: {e}")
    finally:
        for s in servers.values():
            s.stop()
        rec.save()
    print("PREFIX CACHE SUMMARY " + json.dumps({"failed": rec.failures,
                                                "figures": rec.summary.get("figures")}))
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
