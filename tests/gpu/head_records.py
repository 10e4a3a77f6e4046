#!/usr/bin/env python3
"""Real GPU: the INT8 LM head served with the real 122B head shape, and the records profile timed by a proxy.

    python3 tests/gpu/head_records.py --out DIR [--work DIR] [--budget S] [--records-category LIST]
                                      (make gpu-head-records)

Issue 44's GPU evidence (issue 47, items 1 and 2), on a host where ``import vllm`` gives 0.20.0:

1. builds the tiny Qwen3.5-MoE pair with the head of Qwen3.5-122B-A10B, vocab 248320 x hidden 3072
   (``tiny_pair.generate(hidden=3072, rows=248320)``: the layers stay tiny, the embedding and lm_head are
   padded past the tokenizer's 269 ids) and runs OUR pipeline on it (``e2e.build_models``: merge, MTP
   index patch, verify); patches/vllm-0.20.0 applied to a copy of vLLM (``Record.patched``);
2. starts two patched servers at once, both mtp (num_speculative_tokens 2) with the argv
   ``spark_serve_argv`` renders plus e2e.HOST_SETTINGS (--enforce-eager): ``hybrid-mtp`` with the BF16
   head (SPARKLLM_LM_HEAD_INT8=0) and ``hybrid-mtp-int8`` (SPARKLLM_LM_HEAD_INT8=1, what
   ``vllm_lm_head_int8: true`` sets, and the tile cache SPARKLLM_LM_HEAD_INT8_TUNE_DIR under --work).
   Records each server's ``sparkllm: lm_head`` lines (the INT8 load line and the autotune's tile line),
   e2e's INT8 checks (load line, greedy agreement on e2e.PROMPTS, max top-1 logprob difference, MTP
   acceptance), that the quantized head is 248320 x 3072, and the decode tok/s of each from
   ``scripts/bench.py run --profile decode`` (one after the other, same prompts) and their ratio;
3. runs ``scripts/bench.py run --profile records`` against the INT8 server THROUGH a stdlib timing proxy
   (``TimingProxy``: per POST the time it received the request, the time it finished sending the
   response and the response's completion_tokens) and checks the runner against it: the requests as the
   protocol says (non-streamed, no thinking switch, the prompt file's max_tokens), equal token counts,
   each request's e2e tok/s never above tokens / (proxy time) and within E2E_TOL of it, the run's mean
   within MEAN_TOL of the mean recomputed from the proxy's log;
4. writes DIR/summary.json (every figure, every check), prints one line ``HEAD_RECORDS SUMMARY {...}``.

Tiny-model speeds on an H200 say nothing about a Spark (the summary says so); the INT8/BF16 ratio here
is the tiny model's, where the head is a larger share of a step than in the 122B model. Exit 0 every
check passed, 1 one failed, 2 usage or no vLLM/GPU. The servers are stopped however the run ends.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from tests.gpu import e2e

sys.path.insert(0, str(e2e.ROOT / "scripts"))
from sparkllm.bench.common import UsageError  # noqa: E402
from sparkllm.bench.prompts import load_prompts  # noqa: E402

log = e2e.logger("head_records")

# Qwen3.5-122B-A10B's head: vocab_size 248320 (vLLM 0.20.0 vllm/transformers_utils/configs/qwen3_5_moe.py:46,
# the family's) x hidden_size 3072 (the 122B's config; Entrpi's FINDINGS.md times "the BF16 head, 248320 x
# 3072", cited in group_vars/all/main.yml)
HEAD_ROWS, HEAD_COLS = 248320, 3072
LABELS = ("hybrid-mtp", "hybrid-mtp-int8")  # e2e.check_lm_head_int8's names: BF16 head, INT8 head
TUNE_DIR_ENV = "SPARKLLM_LM_HEAD_INT8_TUNE_DIR"  # patches/src/sparkllm_lm_head_int8.py
HEAD_LINE = re.compile(r"sparkllm: lm_head[^\n]*")
TILE_LINE = re.compile(r"sparkllm: lm_head INT8 tiles for (\d+)x(\d+)[^\n]*")
TILE = re.compile(r"M<=(\d+): (\d+x\d+x\d+/w\d+/s\d+)")
TUNE_FAILED = re.compile(r"sparkllm: lm_head INT8 tile autotune failed[^\n]*")
E2E_TOL = 0.03  # a request's runner tok/s at least (1 - E2E_TOL) x the proxy's (loopback: ~1 ms a request)
MEAN_TOL = 0.05  # the run's records mean against the proxy's recomputed mean
AFTER_START_S = 140  # what the probes, the three bench runs and the summary need after the starts
ROUTES_GET = ("/metrics", "/version", "/v1/models", "/health")


# ------------------------------------------------------------------ the timing proxy
class TimingProxy:
    """A threaded stdlib HTTP proxy in front of one server: POST /v1/chat/completions and GET ROUTES_GET
    are forwarded (the upstream's answer read whole, then sent whole); every POST is logged in
    ``entries`` with ``received`` (monotonic, when its handler started: request line and headers read),
    ``finished`` (monotonic, the upstream's whole response in hand, stamped just before it is written
    back), status, completion_tokens and what the request asked (stream, max_tokens, whether
    chat_template_kwargs was sent). Any other route gets 404. The client's own interval starts before it
    connects and ends after it read the last byte, so it contains the proxy's (by causality, on the same
    monotonic clock)."""

    def __init__(self, upstream: str, port: int = 0) -> None:
        u = urllib.parse.urlsplit(upstream)
        self.host, self.up_port = u.hostname or "127.0.0.1", u.port or 80
        self.entries: list[dict] = []
        self.gets: dict[str, int] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> TimingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def forward(self, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, bytes, str]:
        conn = http.client.HTTPConnection(self.host, self.up_port, timeout=900)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.read(), r.getheader("Content-Type") or "application/octet-stream"
        finally:
            conn.close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no line per request on stderr
                pass

            def _send(self, status: int, data: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()

            def do_GET(self) -> None:
                path = urllib.parse.urlsplit(self.path).path
                if path not in ROUTES_GET:
                    self._send(404, b'{"error": "not forwarded by the timing proxy"}', "application/json")
                    return
                with proxy.lock:
                    proxy.gets[path] = proxy.gets.get(path, 0) + 1
                try:
                    self._send(*proxy.forward("GET", self.path, None, {}))
                except OSError as e:
                    self._send(502, f"upstream: {e}".encode(), "text/plain")

            def do_POST(self) -> None:
                received = time.monotonic()
                if urllib.parse.urlsplit(self.path).path != "/v1/chat/completions":
                    self._send(404, b'{"error": "not forwarded by the timing proxy"}', "application/json")
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                entry: dict = {"received": received, **request_fields(body)}
                try:
                    status, data, ctype = proxy.forward("POST", self.path, body,
                                                        {"Content-Type": "application/json"})
                except OSError as e:
                    status, data, ctype = 502, f"upstream: {e}".encode(), "text/plain"
                # stamped before the response is written: the client cannot have read it earlier
                entry.update(finished=time.monotonic(), status=status,
                             completion_tokens=completion_tokens(data) if status == 200 else None)
                self._send(status, data, ctype)
                entry["seconds"] = entry["finished"] - received
                with proxy.lock:
                    proxy.entries.append(entry)

        return Handler


def request_fields(body: bytes) -> dict:
    """What a records request asked for, from its JSON body (None where it is not JSON)."""
    try:
        req = json.loads(body)
    except ValueError:
        return {"stream": None, "max_tokens": None, "thinking_kwarg": None}
    return {"stream": bool(req.get("stream")), "max_tokens": req.get("max_tokens"),
            "thinking_kwarg": "chat_template_kwargs" in req}


def completion_tokens(data: bytes) -> int | None:
    try:
        return int(json.loads(data)["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------ checks (no GPU needed)
def match_records(rows: list[dict], entries: list[dict], e2e_tol: float = E2E_TOL) -> dict:
    """The runner's measured requests (a run document's ``requests``, in order) against the proxy's POSTs:
    the measured ones are the proxy's last len(rows) POSTs (the discarded first pass came before them and
    nothing is POSTed after). Per request: equal completion tokens, the runner's e2e tok/s never above
    tokens / proxy seconds and at least (1 - e2e_tol) of it; the proxy's records mean recomputed as the
    runner defines it (mean over a pass's prompts, mean over passes)."""
    out: dict = {"runner_requests": len(rows), "proxy_posts": len(entries)}
    if not rows or len(entries) < len(rows):
        out.update(ok=False, why="fewer proxy POSTs than measured requests" if rows
                   else "no measured requests")
        return out
    pairs, passes = [], {}
    for row, ent in zip(rows, entries[-len(rows):], strict=True):
        tok = ent.get("completion_tokens")
        proxy_tok_s = tok / ent["seconds"] if tok and ent["seconds"] > 0 else None
        runner = row.get("e2e_tok_s")
        ratio = runner / proxy_tok_s if runner and proxy_tok_s else None
        pairs.append({"prompt_id": row.get("prompt_id"), "repeat": row.get("repeat"),
                      "tokens_runner": row.get("output_tokens"), "tokens_proxy": tok,
                      "e2e_s_runner": row.get("e2e_s"), "seconds_proxy": round(ent["seconds"], 6),
                      "e2e_tok_s_runner": runner, "tok_s_proxy": proxy_tok_s, "runner_over_proxy": ratio})
        passes.setdefault(row.get("repeat"), []).append(proxy_tok_s)
    pass_means = [sum(v) / len(v) for _, v in sorted(passes.items(), key=lambda kv: str(kv[0]))
                  if v and all(x is not None for x in v)]
    ratios = [p["runner_over_proxy"] for p in pairs]
    out.update(
        pairs=pairs,
        tokens_equal=all(p["tokens_runner"] == p["tokens_proxy"] and p["tokens_proxy"] for p in pairs),
        never_above=all(r is not None and r <= 1 + 1e-9 for r in ratios),
        within_tol=all(r is not None and r >= 1 - e2e_tol for r in ratios),
        ratio_min=min((r for r in ratios if r is not None), default=None),
        ratio_max=max((r for r in ratios if r is not None), default=None),
        proxy_mean=sum(pass_means) / len(pass_means) if pass_means and len(pass_means) == len(passes)
        else None)
    out["ok"] = out["tokens_equal"] and out["never_above"] and out["within_tol"]
    return out


def mean_agrees(runner_mean: float | None, proxy_mean: float | None, tol: float = MEAN_TOL) -> dict:
    rel = abs(runner_mean - proxy_mean) / proxy_mean if runner_mean and proxy_mean else None
    return {"ok": rel is not None and rel <= tol, "runner_mean": runner_mean, "proxy_mean": proxy_mean,
            "relative_difference": rel, "tolerance": tol}


def protocol_followed(entries: list[dict], limits: dict[str, int], prompt_ids: list[str]) -> dict:
    """Every POST whole (not streamed), without a thinking switch (the template's default), and asking
    the prompt file's own max_tokens: each selected prompt's limit as often as there were passes (the
    runner orders a pass by category, so the limits are compared as a multiset)."""
    wanted = [limits[p] for p in prompt_ids]
    asked = [e.get("max_tokens") for e in entries]
    passes = len(entries) // len(wanted) if wanted else 0
    per_prompt = bool(passes) and sorted(asked, key=str) == sorted(wanted * passes, key=str)
    out = {"posts": len(entries), "streamed": sum(1 for e in entries if e.get("stream") is not False),
           "thinking_switch_sent": sum(1 for e in entries if e.get("thinking_kwarg") is not False),
           "max_tokens_asked": asked, "max_tokens_of_the_file": wanted, "per_prompt_limits": per_prompt}
    out["ok"] = bool(entries) and not out["streamed"] and not out["thinking_switch_sent"] and per_prompt
    return out


def head_lines(text: str) -> dict:
    """A server log's ``sparkllm: lm_head`` lines: all of them, the tile lines parsed (shape, tiles per
    bucket, how chosen), and any autotune failure."""
    tiles = []
    for m in TILE_LINE.finditer(text):
        line = m.group(0)
        how = ("autotuned" if "autotuned in" in line else "cache" if "from cache" in line
               else "fixed" if "fixed table" in line else "unknown")
        took = re.search(r"autotuned in ([\d.]+) s", line)
        tiles.append({"rows": int(m.group(1)), "cols": int(m.group(2)), "how": how,
                      "seconds": float(took.group(1)) if took else None,
                      "tiles": {int(b): t for b, t in TILE.findall(line)}})
    return {"lines": [ln[:400] for ln in HEAD_LINE.findall(text)], "tiles": tiles,
            "autotune_failed": TUNE_FAILED.findall(text)}


def decode_figure(doc: dict) -> dict:
    med = (doc.get("summary") or {}).get("decode_tok_s") or {}
    sp = doc.get("spec") or {}
    return {"valid": doc.get("valid"), "problems": doc.get("problems"),
            "requests": (doc.get("summary") or {}).get("requests"),
            "decode_tok_s_median": med.get("median") if isinstance(med, dict) else None,
            "acceptance_rate": sp.get("acceptance_rate"),
            "mean_acceptance_length": sp.get("mean_acceptance_length")}


# ------------------------------------------------------------------ the run
def bench(server_url: str, label: str, runs: Path, args: list[str], meta: dict,
          timeout: float) -> tuple[dict | None, str]:
    """One ``bench.py run``; (its run document, or None, and the end of its output)."""
    had = set(runs.glob("*.json")) if runs.exists() else set()
    r = e2e.run([sys.executable, str(e2e.ROOT / "scripts/bench.py"), "run", "--base-url", server_url,
                 "--model", "tiny", "--label", label, "--out", str(runs), "--quiet",
                 "--meta-json", json.dumps(meta), *args], timeout=max(20, timeout))
    new = sorted(set(runs.glob(f"*-{label}-*.json")) - had, key=lambda p: p.stat().st_mtime) \
        if runs.exists() else []
    if r.returncode or not new:
        return None, (r.stdout + r.stderr)[-800:]
    return json.loads(new[-1].read_text()), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="head_records.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results: summary.json, server logs, run JSONs")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-head"),
                    help="scratch: models, patched vLLM, tile cache (default /tmp/sparkllm-gpu-head)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--start-timeout", type=float, default=360, help="seconds for the starts (default 360)")
    ap.add_argument("--decode-max-tokens", type=int, default=64,
                    help="decode bench --max-tokens (default 64)")
    ap.add_argument("--decode-category", default="chat_qa,code",
                    help="decode bench --category (default chat_qa,code: 20 prompts)")
    ap.add_argument("--records-category", default="qa,code,json,math",
                    help="records bench --category, or 'all' (default qa,code,json,math: long_code's 2048 "
                         "tokens twice do not fit the budget beside the starts)")
    a = ap.parse_args(argv)
    prompts_file = e2e.ROOT / "scripts" / "prompts" / "records.jsonl"
    try:
        records_cat = None if a.records_category == "all" else a.records_category
        prompts, _ = load_prompts(prompts_file, records_cat)
    except UsageError as e:
        print(f"head_records.py: --records-category {a.records_category!r}: {e}", file=sys.stderr)
        return 2
    if a.budget < 200 or a.decode_max_tokens < 2:
        print("head_records.py: --budget must be >= 200 s and --decode-max-tokens >= 2", file=sys.stderr)
        return 2
    rec = e2e.Record(a.out, a.work, log, figures={}, servers={},
                     note="tiny-model speeds on an H200: meaningless for a Spark; recorded, never a claim")
    t0, summary, check = rec.t0, rec.summary, rec.check
    host = rec.host("head_records.py")
    if host is None:
        return 2
    summary["records_categories"] = a.records_category  # the default leaves long_code out, for time
    servers: dict[str, e2e.Server] = {}
    with rec.closing(servers):
        models = e2e.build_models(a.work, hidden=HEAD_COLS, rows=HEAD_ROWS)
        summary["pipeline"] = {"merge": models["merge"], "verify_ok": models["verify"]["ok"]}
        _, pp = rec.patched(a.work, host)
        tiles_dir = a.work / "lm-head-tiles"
        envs = {"hybrid-mtp": {"SPARKLLM_LM_HEAD_INT8": "0"},
                "hybrid-mtp-int8": {**e2e.LM_HEAD_INT8_ENV, TUNE_DIR_ENV: str(tiles_dir)}}
        for i, k in enumerate(LABELS):
            servers[k] = e2e.Server(k, "mtp", models["dirs"]["hybrid"], 8401 + i, pp, a.out, envs[k])
            servers[k].start()
        log("started " + ", ".join(f"{k}:{s.port}" for k, s in servers.items()))
        deadline = time.monotonic() + min(a.start_timeout, a.budget - (time.monotonic() - t0) - AFTER_START_S)
        while time.monotonic() < deadline and any(s.poll() == "starting" for s in servers.values()):
            time.sleep(2)
        results, text = {}, {k: s.log_text() for k, s in servers.items()}
        for k, s in servers.items():
            state = s.poll()
            ready = None if s.healthy_after is None else round(s.healthy_after, 1)
            summary["servers"][k] = {"state": state, "exit_code": s.exit_code, "argv": s.argv,
                                     "env": envs[k], "ready_s": ready, **head_lines(text[k])}
            if state == "up":
                try:
                    results[k] = e2e.probe(s)
                except (OSError, ValueError, KeyError) as e:
                    summary["servers"][k]["probe_error"] = f"{type(e).__name__}: {e}"
            check(f"{k} serves", k in results, {x: summary["servers"][k][x] for x in ("state", "ready_s")})
        rec.save()
        counters = {k: e2e.scrape(servers[k]) for k in results}
        if "hybrid-mtp" in results:
            succ = e2e.follows_successors(results["hybrid-mtp"])
            check("the 3072-wide tiny model answers as built (successor map)", succ >= len(e2e.PROMPTS) - 1,
                  f"{succ}/{len(e2e.PROMPTS)}")
        e2e.check_lm_head_int8(check, summary, text, results, counters)
        target = [ln for ln in e2e.lm_head_lines(text["hybrid-mtp-int8"]) if "MTP" not in ln["model"]]
        check(f"int8 lm_head: the real head shape {HEAD_ROWS}x{HEAD_COLS} quantized",
              bool(target) and all((ln["rows"], ln["cols"]) == (HEAD_ROWS, HEAD_COLS) for ln in target),
              target)
        tiles = summary["servers"]["hybrid-mtp-int8"]
        check("int8 lm_head: tiles chosen for this device (autotuned or from its cache), logged",
              any(t["how"] in ("autotuned", "cache") and (t["rows"], t["cols"]) == (HEAD_ROWS, HEAD_COLS)
                  and t["tiles"] for t in tiles["tiles"]) and not tiles["autotune_failed"],
              {"tiles": tiles["tiles"], "autotune_failed": tiles["autotune_failed"],
               "cache_files": sorted(p.name for p in tiles_dir.glob("*.json")) if tiles_dir.is_dir() else []})
        rec.save()
        runs = a.out / "runs"
        decode = {}
        for k in LABELS:
            left = a.budget - (time.monotonic() - t0)
            if k not in results or left < 60:
                check(f"{k}: decode bench valid", False,
                      "not served" if k not in results else f"no time left ({left:.0f} s)")
                continue
            meta = {"serve_argv": servers[k].argv, "gpu": host["gpu"], "vllm": host["vllm"],
                    "lm_head": "int8" if k.endswith("int8") else "bf16"}
            doc, err = bench(servers[k].url, f"decode-{meta['lm_head']}", runs,
                             ["--profile", "decode", "--warmup", "1", "--max-tokens",
                              str(a.decode_max_tokens), "--category", a.decode_category], meta, left - 50)
            decode[k] = decode_figure(doc) if doc else None
            check(f"{k}: decode bench valid", bool(doc and doc.get("valid")), decode[k] or err)
        fig = summary["figures"]
        fig["decode_tok_s"] = {k: (v or {}).get("decode_tok_s_median") for k, v in decode.items()}
        fig["decode_runs"] = decode
        bf, i8 = (fig["decode_tok_s"].get(k) for k in LABELS)
        fig["decode_int8_over_bf16"] = round(i8 / bf, 4) if bf and i8 else None
        log(f"decode tok/s (tiny model): {fig['decode_tok_s']}, INT8/BF16 {fig['decode_int8_over_bf16']}")
        rec.save()
        left = a.budget - (time.monotonic() - t0)
        if "hybrid-mtp-int8" not in results or left < 40:
            check("records run through the timing proxy", False, f"not served or no time ({left:.0f} s)")
        else:
            s = servers["hybrid-mtp-int8"]
            with TimingProxy(s.url) as proxy:
                meta = {"serve_argv": s.argv, "gpu": host["gpu"], "vllm": host["vllm"], "lm_head": "int8",
                        "via": "head_records.py timing proxy"}
                doc, err = bench(proxy.url, "records-int8", runs,
                                 ["--profile", "records", "--repeats", "1",
                                  *(["--category", records_cat] if records_cat else [])], meta, left - 15)
            entries = list(proxy.entries)
            (a.out / "proxy-log.json").write_text(json.dumps({"posts": entries, "gets": proxy.gets},
                                                             indent=1))
            check("records run valid", bool(doc and doc.get("valid")),
                  {"problems": doc.get("problems"), "records": doc.get("records")} if doc else err)
            if doc:
                fig["records"] = doc.get("records")
                limits = {p.id: p.max_tokens for p in prompts}
                proto = protocol_followed(entries, limits, [p.id for p in prompts])
                check("records requests as the protocol says (whole, template's thinking, per-prompt limits)",
                      proto["ok"], proto)
                m = match_records(doc.get("requests") or [], entries)
                fig["records_vs_proxy"] = m
                keys = ("tokens_equal", "never_above", "within_tol", "ratio_min", "ratio_max", "why")
                check(f"records: each request's e2e tok/s <= the proxy's, within {E2E_TOL:.0%}, same tokens",
                      m["ok"], {x: m.get(x) for x in keys})
                agree = mean_agrees((doc.get("records") or {}).get("tok_s_mean"), m.get("proxy_mean"))
                fig["records_mean"] = agree
                check(f"records: the run's mean within {MEAN_TOL:.0%} of the proxy's", agree["ok"], agree)
    fig = summary["figures"]
    line = {k: summary.get(k) for k in ("host", "failed", "seconds")} | {
        "decode_tok_s": fig.get("decode_tok_s"), "int8_over_bf16": fig.get("decode_int8_over_bf16"),
        "records_mean": fig.get("records_mean")}
    print("HEAD_RECORDS SUMMARY " + json.dumps(line, default=str), flush=True)
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
