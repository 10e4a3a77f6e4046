#!/usr/bin/env python3
"""Real GPU: one model catalogue entry served through OUR rendered argv, baseline and MTP at once.

    python3 tests/gpu/model_entry.py --out DIR [--work DIR] [--model NAME] [--budget SECONDS] [--stock]
    (make gpu-model; issue 49 item 3)

On a host where ``import vllm`` works (vLLM 0.20.0 on the H200 host, docs/gpu-e2e/README.md), for the
entry NAME of group_vars/all/models.yml (default qwen3.6-35b-a3b-fp8; an entry served as fetched,
``assembly: none``), it

1. builds a tiny checkpoint of the entry's architecture with the project's generator
   (tests/gpu/tiny_pair.py ``<work>/pair/fp8``: Qwen3_5MoeForConditionalGeneration in Qwen's block-FP8
   layout, mtp.* in the index) and checks it with ``scripts/verify_checkpoint.py --expect-mtp``;
2. renders each server's argv through the deploy's path: ``SETTING_DEFAULTS``, then the entry's
   ``serve:`` values, ``vllm_serve_extra_args`` = the entry's ``extra_args`` + the host flags of
   e2e.HOST_SETTINGS, then ``spark_serve_argv(settings, spark_method_catalogue)``; only what a tiny
   model on this host cannot take is overridden, each override recorded with its reason (``render``);
3. starts baseline and mtp at once (e2e.Server), asks both the same greedy completions (e2e.probe),
   runs ``scripts/bench.py run`` against mtp and checks: both servers up with the entry's flags in
   their argv, the log shows the KV-cache dtype the entry asks for (0.20.0 logs it twice:
   ``Using fp8 data type to store kv cache`` from vllm/config/cache.py:261-267 and ``kv_cache_dtype=fp8``
   in the engine's config line, vllm/config/vllm.py:1774 via vllm/v1/engine/core.py:109-112), greedy
   text follows the tiny model's successor machine, mtp's tokens equal baseline's, /metrics counts
   drafts with acceptance >= e2e.MTP_MIN_ACCEPTANCE, the runner's figures equal the counter deltas.
   A server that dies (e.g. an fp8 KV cache this host cannot take: FLASH_ATTN takes one only with
   FlashAttention 3 on compute capability 9.x, vllm/v1/attention/backends/flash_attn.py:188-193 and
   fa_utils.py:187-193) is a named failed check with its log tail; every wait ends by --budget.
Prints one ``MODEL SUMMARY {...}`` line, writes DIR/summary.json and DIR/vllm-*.log; exit 0 every
check passed, 1 one failed, 2 usage (unknown model, an entry this proof cannot build, no vLLM here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "filter_plugins")]  # tests.gpu.* and the filters, run as a script
from spark_methods import SETTING_DEFAULTS, spark_serve_argv, spark_server_env  # noqa: E402

from tests.gpu import e2e, tiny_pair  # noqa: E402

MODELS_YML = ROOT / "group_vars" / "all" / "models.yml"
DEFAULT_MODEL = "qwen3.6-35b-a3b-fp8"
METHODS = ("baseline", "mtp")
PORTS = {"baseline": 8501, "mtp": 8502}
TINY_MAX_MODEL_LEN = 2048  # under tiny_pair.MAX_POS (the tiny config's max_position_embeddings)
KV_LOG = re.compile(r"Using (\w+) data type to store kv cache")  # vllm/config/cache.py:261-267 (0.20.0)
KV_CONFIG = re.compile(r"kv_cache_dtype=(\w+)")  # vllm/config/vllm.py:1774 (0.20.0)
FST_LOG = re.compile(r"Fastsafetensor loader")  # vllm/model_executor/model_loader/weight_utils.py:1112
RESERVE_S = 110  # of the budget, kept for the probes and the bench run once the servers are up
log = e2e.logger("model")


class Usage(Exception):
    """Refused before any work (exit 2); the message names the problem and the fix."""


def load_entry(name: str, path: Path = MODELS_YML) -> dict:
    """The catalogue entry ``name``; Usage for an unknown name or an entry this proof cannot build."""
    import yaml

    catalogue = yaml.safe_load(path.read_text(encoding="utf-8"))["spark_model_catalogue"]
    if name not in catalogue:
        raise Usage(f"unknown model {name!r}; give --model one of: {', '.join(catalogue)} ({path})")
    entry = catalogue[name]
    if entry.get("assembly") != "none":
        raise Usage(f"model {name!r} is assembled ({entry.get('assembly')}); this proof serves a plain "
                    "checkpoint as fetched (tests/gpu/e2e.py proves the hybrid): give an entry with "
                    "assembly: none")
    missing = [m for m in METHODS if m not in (entry.get("methods") or {})]
    if missing:
        raise Usage(f"model {name!r} does not list the methods {missing} this proof serves; give an entry "
                    f"whose methods include {', '.join(METHODS)}")
    return entry


def render(entry: dict, method: str, model_path: str, fastsafetensors: bool) -> dict:
    """The entry's settings for ``method`` as the deploy builds them, the overrides a tiny model on this
    host needs (name -> entry's value, value used, reason), the argv spark_serve_argv renders, and the
    server environment (spark_server_env: the method's, the INT8 head switch, the entry's server_env)."""
    serve = dict(entry.get("serve") or {})
    unknown = sorted(set(serve) - set(SETTING_DEFAULTS))
    if unknown:
        raise Usage(f"the entry's serve keys {unknown} are not settings of group_vars/all/main.yml; "
                    "fix the entry")
    extra = [str(a) for a in entry.get("extra_args") or []]
    host_flags = list(e2e.HOST_SETTINGS["vllm_serve_extra_args"])
    settings = dict(SETTING_DEFAULTS, **serve, spec_method=method, vllm_serve_extra_args=extra + host_flags)
    overrides: dict[str, dict] = {}

    def override(name: str, value, why: str) -> None:
        overrides[name] = {"entry": settings.get(name), "used": value, "why": why}
        settings[name] = value

    override("vllm_model_path", model_path, "the tiny checkpoint built here (the serve role mounts "
             "the entry's model_dir at /model)")
    override("vllm_port", PORTS[method], "two servers at once on one host")
    override("vllm_served_model_name", e2e.TEST_OVERRIDES["vllm_served_model_name"],
             "e2e.probe and the bench run ask for the model 'tiny'")
    override("vllm_max_model_len", TINY_MAX_MODEL_LEN, f"the tiny config's max_position_embeddings is "
             f"{tiny_pair.MAX_POS}; vLLM refuses a longer context")
    override("vllm_gpu_memory_utilization", e2e.TEST_OVERRIDES["vllm_gpu_memory_utilization"],
             "two servers share one GPU; the KV cache is fixed by the host flag --kv-cache-memory-bytes")
    override("vllm_attention_backend", e2e.HOST_SETTINGS["vllm_attention_backend"],
             "FlashInfer's attention kernels are compiled at first use and this host has no nvcc "
             "(e2e.HOST_SETTINGS); the Spark keeps the catalogue's backend")
    if settings.get("vllm_load_format") == "fastsafetensors" and not fastsafetensors:
        override("vllm_load_format", "safetensors", "fastsafetensors is not importable on this host "
                 "(importlib.util.find_spec)")
    argv = spark_serve_argv(settings, e2e.load_catalogue())
    env = spark_server_env(method, e2e.load_catalogue(), serve.get("vllm_lm_head_int8", False),
                           entry.get("server_env") or {})
    return {"settings": settings, "overrides": overrides, "argv": argv, "env": env,
            "entry_extra_args": extra, "host_flags_appended": host_flags}


class EntryServer(e2e.Server):
    """e2e's Server started with a rendered entry: its settings cover every name of SETTING_DEFAULTS,
    so e2e's own defaults underneath change nothing and the argv is render()'s."""

    def __init__(self, label: str, rendered: dict, pythonpath: str, logs: Path):
        s = rendered["settings"]
        super().__init__(label, s["spec_method"], s["vllm_model_path"], s["vllm_port"], pythonpath, logs,
                         rendered["env"], extra_settings=s)


def has_run(argv: list[str], words: list[str]) -> bool:
    """``words`` appear in ``argv`` as one contiguous run (an option and its value together)."""
    n = len(words)
    return n == 0 or any(argv[i:i + n] == words for i in range(len(argv) - n + 1))


def option_value(argv: list[str], option: str) -> str | None:
    return argv[argv.index(option) + 1] if option in argv and argv.index(option) + 1 < len(argv) else None


def log_tail(text: str, lines: int = 25) -> list[str]:
    return [ln[:300] for ln in text.splitlines()[-lines:]]


def probe_all(servers: dict, timeout: float) -> tuple[dict, dict]:
    """e2e.probe of every server at once, in daemon threads joined within ``timeout`` seconds (a
    server that stops answering is an error, never a hang)."""
    results: dict = {}
    errors: dict = {}

    def one(k: str) -> None:
        try:
            results[k] = e2e.probe(servers[k])
        except Exception as exc:  # noqa: BLE001 (recorded: a failed probe is a finding)
            errors[k] = f"{type(exc).__name__}: {exc}"[:400]

    threads = {k: threading.Thread(target=one, args=(k,), daemon=True) for k in servers}
    for t in threads.values():
        t.start()
    end = time.monotonic() + timeout
    for k, t in threads.items():
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            errors[k] = f"no answer within {timeout:.0f} s"
    return {k: v for k, v in results.items() if k not in errors}, errors


def bench_mtp(rec: e2e.Record, server: e2e.Server, out: Path, gpu: str, left: float, max_tokens: int) -> None:
    """scripts/bench.py run against the mtp server, as e2e.py runs it, and its counters checked."""
    check, runs = rec.check, out / "runs"
    if left < 45:
        check("mtp: bench run", False, f"no time left ({left:.0f} s)")
        return
    meta = {"speculative_config": json.loads(option_value(server.argv, "--speculative-config") or "null"),
            "serve_argv": server.argv, "gpu": gpu}
    before = e2e.scrape(server)
    with e2e.CounterWatch(server) as watch:
        r = e2e.run([sys.executable, str(ROOT / "scripts/bench.py"), "run", "--base-url", server.url,
                     "--model", "tiny", "--label", "mtp", "--out", str(runs), "--warmup", "1",
                     "--max-tokens", str(max_tokens), "--category", "chat_qa,code,json,math", "--quiet",
                     "--meta-json", json.dumps(meta)], timeout=max(30, left - 15))
    after = e2e.scrape(server)
    docs = sorted(runs.glob("*-mtp-*.json")) if runs.exists() else []
    if r.returncode or not docs:
        check("mtp: bench run", False, (r.stdout + r.stderr)[-800:])
        return
    doc = json.loads(docs[-1].read_text())
    sp, counters = doc["spec"], doc.get("spec_counters", {})
    fig = {"valid": doc["valid"], "problems": doc["problems"], "requests": doc["summary"].get("requests"),
           "acceptance_rate": sp.get("acceptance_rate"), "per_position": sp.get("per_position"),
           "mean_acceptance_length": sp.get("mean_acceptance_length"), "num_drafts": sp.get("num_drafts")}
    rec.summary["figures"]["bench-mtp"] = fig
    check("mtp: bench run valid", doc["valid"], fig)
    agree = e2e.runner_matches_counters(sp, counters, before, after)
    check("mtp: runner's acceptance = /metrics deltas of its measured phase", agree["ok"], agree)
    own = e2e.runner_vs_own_readings(sp, counters, watch.readings, after)
    own.update(scrapes=watch.scrapes, scrape_errors=watch.errors)
    check("mtp: runner's drafts, draft tokens, accepted, per position = deltas of our own readings",
          own["ok"], own)
    rate = sp.get("acceptance_rate")
    check("mtp bench: drafts counted, acceptance >= MTP_MIN_ACCEPTANCE",
          bool(agree["counters"]["drafts"]) and rate is not None and rate >= e2e.MTP_MIN_ACCEPTANCE,
          {"drafts": agree["counters"]["drafts"], "acceptance_rate": rate, "min": e2e.MTP_MIN_ACCEPTANCE})


def check_servers(rec: e2e.Record, servers: dict, rendered: dict, states: dict) -> None:
    """Up, the entry's flags in argv, the KV-cache dtype the entry asks for in the log; a server that is
    not up is a finding with its log tail."""
    for k, s in servers.items():
        text = s.log_text()
        extra = rendered[k]["entry_extra_args"]
        info = {"state": states[k], "ready_s": None if s.healthy_after is None else round(s.healthy_after, 1),
                "exit_code": s.exit_code, "argv": s.argv, "log": str(s.log_path)}
        if states[k] != "up":
            info["log_tail"] = log_tail(text)
            info["error_lines"] = [ln[:300] for ln in text.splitlines()
                                   if re.search(r"Error|error:|not support|Traceback", ln)][-6:]
        info["kernel_lines"] = sorted({m.strip()[:160] for m in re.findall(
            r"[^\n]*(?:Fp8|FP8|fp8|MoE backend|attention backend|Using \w+ backend)[^\n]*", text)})[:12]
        rec.summary["servers"][k] = info
        brief = {x: info[x] for x in ("state", "ready_s", "exit_code")}
        if states[k] != "up":
            brief["log_tail"] = info["log_tail"][-8:]
        rec.check(f"{k} serves (with the entry's flags)", states[k] == "up", brief)
        flags = {"entry extra_args": has_run(s.argv, extra),
                 "reasoning parser": has_run(s.argv, ["--reasoning-parser", str(
                     rendered[k]["settings"]["vllm_reasoning_parser"])]),
                 "tool-call parser": has_run(s.argv, ["--tool-call-parser", str(
                     rendered[k]["settings"]["vllm_tool_call_parser"])])}
        spec = option_value(s.argv, "--speculative-config")
        if k == "mtp":
            flags["mtp speculative config"] = spec is not None and json.loads(spec).get("method") == "mtp"
        else:
            flags["no speculative config"] = spec is None
        rec.check(f"{k}: argv carries the entry's flags", all(flags.values()), flags)
        kv = option_value(s.argv, "--kv-cache-dtype")
        if kv is not None:
            seen = {"log": KV_LOG.findall(text)[:3], "engine_config": KV_CONFIG.findall(text)[:3]}
            if states[k] != "up":  # the finding: what stopped it, from its log
                seen["error_lines"] = info["error_lines"]
            rec.check(f"{k}: serves with the {kv} KV cache (the log shows it)", states[k] == "up" and (
                kv in seen["log"] or kv in seen["engine_config"]), seen)
        if option_value(s.argv, "--load-format") == "fastsafetensors" and states[k] == "up":
            rec.check(f"{k}: weights loaded by fastsafetensors", bool(FST_LOG.search(text)), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="model_entry.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results: summary.json, server logs, run JSON")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-model"),
                    help="scratch directory for the tiny checkpoint (default /tmp/sparkllm-gpu-model)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalogue entry (default {DEFAULT_MODEL})")
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run (default 420)")
    ap.add_argument("--stock", action="store_true",
                    help="serve with the installed vLLM (default: a copy with our patch series, as deployed)")
    ap.add_argument("--bench-max-tokens", type=int, default=128, help="bench.py --max-tokens (default 128)")
    a = ap.parse_args(argv)
    fst = importlib.util.find_spec("fastsafetensors") is not None
    ckpt = a.work.resolve() / "pair" / "fp8"
    try:
        if a.budget < RESERVE_S + 60:
            raise Usage(f"--budget {a.budget:.0f} leaves no time to start a server; give at least "
                        f"{RESERVE_S + 60}")
        entry = load_entry(a.model)
        rendered = {m: render(entry, m, str(ckpt), fst) for m in METHODS}
    except (Usage, ValueError) as exc:
        print(f"model_entry.py: {exc}", file=sys.stderr)
        return 2
    rec = e2e.Record(a.out, a.work, log, model={"name": a.model, "entry": entry}, figures={}, servers={})
    summary, check = rec.summary, rec.check
    host = rec.host("model_entry.py")
    if host is None:
        return 2
    summary["model"].update(
        fastsafetensors_importable=fst, overrides=rendered["mtp"]["overrides"],
        host_flags_appended=rendered["mtp"]["host_flags_appended"], server_env=rendered["mtp"]["env"],
        variant={"entry": entry.get("vllm_variant"), "served_by": host["vllm"],
                 "why": "the GPU host's torch 2.11 runs vLLM 0.20.0 only (docs/gpu-e2e/README.md)"})
    log(f"host: {summary['host']}; entry {a.model}; fastsafetensors importable: {fst}")
    try:
        info = tiny_pair.generate(a.work / "pair")
    except FileExistsError as exc:
        print(f"model_entry.py: {exc}", file=sys.stderr)
        return 2
    summary["checkpoint"] = {"path": info["fp8"], "files": info["fp8_files"]}
    verify = e2e.run([sys.executable, str(ROOT / "scripts/verify_checkpoint.py"), info["fp8"],
                      "--expect-mtp", "--json"], timeout=120)
    try:
        summary["checkpoint"]["verify"] = json.loads(verify.stdout)
    except ValueError:
        summary["checkpoint"]["verify"] = (verify.stdout + verify.stderr)[-600:]
    check("checkpoint: verify_checkpoint.py --expect-mtp accepts the tiny FP8 checkpoint",
          verify.returncode == 0, summary["checkpoint"]["verify"])
    if a.stock:
        pp = os.pathsep.join([host["site"], os.environ.get("PYTHONPATH", "")])
        summary["patches_applied"] = []
    else:
        pp = rec.patched(a.work, host)[1]
    servers = {m: EntryServer(m, rendered[m], pp, a.out) for m in METHODS}
    with rec.closing(servers):
        for s in servers.values():
            s.start()
        log("started " + ", ".join(f"{s.label}:{s.port}" for s in servers.values()))
        deadline = rec.t0 + a.budget - RESERVE_S
        while time.monotonic() < deadline and any(s.poll() == "starting" for s in servers.values()):
            time.sleep(2)
        states = {k: s.poll() for k, s in servers.items()}
        log(f"server states: { {k: (v, servers[k].healthy_after) for k, v in states.items()} }")
        check_servers(rec, servers, rendered, states)
        up = {k: s for k, s in servers.items() if states[k] == "up"}
        left = a.budget - (time.monotonic() - rec.t0)
        results, errors = probe_all(up, min(90.0, max(10.0, left - 60)))
        summary["probe_errors"] = errors
        for k, r in results.items():
            (a.out / f"probe-{k}.json").write_text(json.dumps(r, indent=1))
            n = e2e.follows_successors(r)
            check(f"{k}: greedy text follows the tiny model's successor machine", n >= len(e2e.PROMPTS) - 1,
                  f"{n}/{len(e2e.PROMPTS)} prompts")
        for k in up:
            if k not in results:
                check(f"{k}: greedy completions answered", False, errors.get(k))
        if "baseline" in results and "mtp" in results:
            cmp = e2e.compare(results["baseline"], results["mtp"])
            summary["figures"]["mtp_vs_baseline"] = cmp
            check("mtp: same greedy tokens as baseline (lossless)",
                  cmp["same_tokens"] >= len(e2e.PROMPTS) - 1, cmp)
        if "mtp" in results:
            m = e2e.scrape(up["mtp"])
            fig = {"drafts": m.get(e2e.DRAFTS), "draft_tokens": m.get(e2e.DRAFT_TOKENS),
                   "accepted": m.get(e2e.ACCEPTED), "acceptance": e2e.acceptance(m)}
            summary["figures"]["mtp_probe"] = fig
            check("mtp: /metrics counts drafts, acceptance over the probes >= MTP_MIN_ACCEPTANCE",
                  bool(fig["drafts"]) and fig["acceptance"] is not None
                  and fig["acceptance"] >= e2e.MTP_MIN_ACCEPTANCE, fig)
        if "mtp" in up:  # the runner's counters are checked even where the probes failed
            bench_mtp(rec, up["mtp"], a.out, host["gpu"], a.budget - (time.monotonic() - rec.t0),
                      a.bench_max_tokens)
    brief = {k: summary.get(k) for k in ("host", "figures", "failed", "seconds")}
    brief.update(model=a.model, overrides=sorted(summary["model"]["overrides"]),
                 servers={k: v["state"] for k, v in summary["servers"].items()})
    print("MODEL SUMMARY " + json.dumps(brief, default=str), flush=True)
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
