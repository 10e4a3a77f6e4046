#!/usr/bin/env python3
"""Real GPU, vLLM 0.26.0: DFlash with a tiny drafter, and the benchmark runner on real servers.

    python3 tests/gpu/dflash_bench.py --out DIR [--work DIR] [--budget S] [--max-tokens N]

On a host where ``import vllm`` gives 0.26.0 (tests/gpu/prepare_v026.sh + gpu_host.sh), it builds
our hybrid with our pipeline (e2e.build_models), applies patches/vllm-0.26.0/ to a copy of vLLM
(e2e.patched_vllm), writes the tiny DFlash drafter (tiny_dflash.py) and starts, at once, one patched
server per case with the argv ``spark_serve_argv`` renders for its method and the environment its
catalogue entry sets (``server_env``: DFlash's V2 model runner), the host's flags through the owners'
knobs as in e2e.HOST_SETTINGS:

  base          baseline, FLASH_ATTN, --enforce-eager   (the reference)
  mtp           mtp, --enforce-eager
  dflash        dflash (FLASH_ATTN, the catalogue's), --enforce-eager
  dflash-graph  dflash as rendered: CUDA graphs (no --enforce-eager)
  dflash-graph-s1  the same with --graph-extra appended (default --max-num-seqs 1: fewer capture sizes)
  dflash-graph-fa  the same with the drafter's attention backend FLASH_ATTN (the 12-02 runs')

The default --cases is the first three (eager: on a cold H200 the three starting at once were ready
in 321-332 s, the bench runs took 176 s: 508 s of one 600 s call; the default --budget 580 leaves the
starts 380 s). ``--cases base,dflash-graph --no-bench`` (``make gpu-dflash-graph``) runs the
CUDA-graph start alone with the baseline as its reference: on a cold host its Triton compile takes
about 400 s, so it needs a call of its own. ``--dump-stuck`` makes every server's EngineCore print
its Python stacks (faulthandler, SIGABRT) when its start outlasts the start deadline, and the summary
keeps a timeline (each starting case's last log line, ptxas processes, Triton cache entries,
load average every 15 s) and each stuck case's log tail.

Checks: each serves; greedy tokens equal base's; drafts are counted in /metrics; DFlash's
per-position acceptance (the drafter is built so position 0 is right). Then ``scripts/bench.py run
--concurrency 1,2,4`` against base twice (the second run is the output check's noise floor), mtp
and dflash, one after the other; for the speculative ones every run's acceptance must equal the
counter deltas it recorded, and the first/last snapshots must agree with our own scrapes taken just
before and after; then ``bench.py report``. nvidia-smi telemetry is the runner's own.

Writes DIR/summary.json, DIR/vllm-CASE.log, DIR/phases-CASE.log, DIR/runs/ (run JSONs and the
results store) and DIR/report/. Exit 0 every check passed, 1 one failed, 2 usage or no vLLM/GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from spark_methods import spark_serve_argv

from tests.gpu import e2e, tiny_dflash
from tests.gpu import first_start as fs

log = e2e.logger("dflash_bench")

CASES = {
    "base": {"method": "baseline", "eager": True, "ref": None},
    "mtp": {"method": "mtp", "eager": True, "ref": "base"},
    "dflash": {"method": "dflash", "eager": True, "ref": "base"},
    "dflash-graph": {"method": "dflash", "eager": False, "ref": "base"},
    "dflash-graph-s1": {"method": "dflash", "eager": False, "ref": "base", "argv_extra": True},
    "dflash-graph-fa": {"method": "dflash", "eager": False, "ref": "base", "drafter_backend": "FLASH_ATTN"},
}
DEFAULT_CASES = ("base", "mtp", "dflash")
ENGINE_PID_RE = re.compile(r"\(EngineCore[^ )]* pid=(\d+)\)")
BENCH = [("base", "baseline"), ("base", "baseline"), ("mtp", "mtp"), ("dflash", "dflash")]
BACKEND_RE = r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend\b"
BENCH_SECONDS = 200  # what the bench runs and the report need after the starts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    # Never a path naming a method: vLLM drafts mtp from the target's path and guesses the method from
    # it ("dflash" in /tmp/sparkllm-dflash switched mtp to dflash; the filter now refuses such a path).
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-spec"),
                    help="scratch directory for the models (default /tmp/sparkllm-gpu-spec)")
    ap.add_argument("--budget", type=float, default=580,
                    help="seconds for the whole run (default 580: one GPU-host call may run 600)")
    ap.add_argument("--max-tokens", type=int, default=64, help="bench.py --max-tokens (default 64)")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma-separated, base included, from {', '.join(CASES)} (default the first four)")
    ap.add_argument("--no-bench", action="store_true",
                    help="starts and checks only: no bench.py runs, no report (the starts get the budget)")
    ap.add_argument("--graph-extra", default="--max-num-seqs 1",
                    help="vllm serve arguments appended for case dflash-graph-s1 (default --max-num-seqs 1)")
    ap.add_argument("--dump-stuck", action="store_true",
                    help="at the start deadline, SIGABRT each still-starting EngineCore (its stacks)")
    ap.add_argument("--moe-backend", default="auto",
                    help="the host's --moe-backend, or auto: no flag (default auto)")
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    if not names or any(c not in CASES for c in names) or "base" not in names:
        print(f"dflash_bench.py: cases must include base and come from {', '.join(CASES)}", file=sys.stderr)
        return 2
    rec = e2e.Record(a.out, a.work, log, cases={}, bench={})
    t0, summary, failures, check, save = rec.t0, rec.summary, rec.failures, rec.check, rec.save
    host = rec.host("dflash_bench.py")
    if host is None:
        return 2
    models = e2e.build_models(a.work)
    summary["pipeline_verify_ok"] = models["verify"]["ok"]
    patched, pp = rec.patched(a.work, host)
    hybrid = models["dirs"]["hybrid"]
    drafter = tiny_dflash.generate(a.work / "dflash-drafter", tokenizer_from=Path(hybrid))["path"]
    catalogue = e2e.load_catalogue()
    servers: dict[str, e2e.Server] = {}
    for i, name in enumerate(names):
        case = CASES[name]
        s = e2e.Server(name, "baseline", hybrid, 8301 + i, pp, a.out)
        s.method = case["method"]
        settings = fs.case_settings(case, hybrid, 8301 + i, None)
        settings["spec_dflash_drafter"] = drafter
        if case.get("drafter_backend"):
            settings["spec_dflash_attention_backend"] = case["drafter_backend"]
        # vLLM 0.26.0 refuses e2e's --moe-backend triton for WNA16 MoE (seen on the host: "Expected one
        # of ['marlin', 'humming', 'flashinfer_trtllm', 'emulation']"); Marlin is in the wheel
        # and marlin for the MTP layer's unquantized MoE ("Expected one of ['triton', ...]"): "auto"
        # leaves the flag out and lets vLLM choose per layer
        extra = settings["vllm_serve_extra_args"]
        i = extra.index("--moe-backend")
        if a.moe_backend == "auto":
            del extra[i:i + 2]
        else:
            extra[i + 1] = a.moe_backend
        s.argv = spark_serve_argv(settings, catalogue)
        if case.get("argv_extra"):
            s.argv += shlex.split(a.graph_extra)  # argparse: the last --max-num-seqs wins
        if a.dump_stuck:
            s.env["PYTHONFAULTHANDLER"] = "1"
        s.env.update({k: str(v) for k, v in (catalogue[case["method"]].get("server_env") or {}).items()})
        s.env["VLLM_CACHE_ROOT"] = str(a.work / f"vllm-cache-{name}")
        servers[name] = s
        summary["cases"][name] = {"argv": s.argv,
                                  "server_env": catalogue[case["method"]].get("server_env") or {}}
    for s in servers.values():
        s.start()
    log("started " + ", ".join(f"{k}:{s.port}" for k, s in servers.items()))
    seen: dict[str, dict[str, float]] = {k: {} for k in servers}
    states = {k: "starting" for k in servers}
    deadline = t0 + a.budget - (30 if a.no_bench else BENCH_SECONDS)
    summary["start_deadline_s"] = round(deadline - t0, 1)
    timeline: list[dict] = []
    summary["timeline"] = timeline
    next_sample = time.monotonic()
    try:
        while time.monotonic() < deadline and "starting" in states.values():
            for k, s in servers.items():
                if states[k] == "starting":
                    fs.phase_times(s.log_text(), seen[k], time.monotonic() - s.t0)
                    states[k] = s.poll()
            if time.monotonic() >= next_sample:
                next_sample += 15
                timeline.append(host_sample(t0) | {k: last_line(servers[k].log_text())
                                                   for k in servers if states[k] == "starting"})
            time.sleep(0.5)
        for k, s in servers.items():
            if states[k] != "starting":
                continue
            text = s.log_text()
            summary["cases"][k]["tail_at_deadline"] = [ln[:300] for ln in text.splitlines()[-60:]]
            pids = ENGINE_PID_RE.findall(text)
            if a.dump_stuck and pids:
                try:
                    os.kill(int(pids[-1]), signal.SIGABRT)
                    time.sleep(4)
                    after = s.log_text()[len(text):]
                    summary["cases"][k]["stacks_at_deadline"] = [ln[:300] for ln in after.splitlines()[:200]]
                except ProcessLookupError:
                    summary["cases"][k]["stacks_at_deadline"] = "EngineCore gone"
        for k, s in servers.items():
            text = s.log_text()
            fs.phase_times(text, seen[k], time.monotonic() - s.t0)
            errors = [ln[:400] for ln in text.splitlines() if re.search(r"Error|error:|Traceback", ln)][-10:]
            summary["cases"][k].update(
                state=states[k], exit_code=s.exit_code, first_seen_s=seen[k], spans_s=fs.phase_spans(seen[k]),
                ready_s=None if s.healthy_after is None else round(s.healthy_after, 1),
                vllm_figures=fs.figures(text), errors=errors,
                backends=sorted(set(re.findall(BACKEND_RE, text))))
            header = (f"# cut from a real first start: {host['gpu']}, vLLM {host['vllm']}, "
                      f"torch {host['torch']}, {summary['host']['date']}, case {k} ({states[k]}); "
                      "argv: vllm serve " + " ".join(s.argv))
            (a.out / f"phases-{k}.log").write_text(fs.cut_log(text, header))
        log("states: " + json.dumps(states))
        save()
        results = {}
        for k, s in servers.items():
            if states[k] == "up":
                try:
                    results[k] = e2e.probe(s)
                    if CASES[k]["method"] != "baseline":
                        summary["cases"][k]["spec"] = fs.spec_counts(s)
                except (OSError, ValueError, KeyError) as e:
                    summary["cases"][k]["probe_error"] = f"{type(e).__name__}: {e}"
        for k in servers:
            check(f"{k} serves", k in results, {x: summary["cases"][k].get(x)
                                                for x in ("state", "ready_s", "exit_code", "errors")})
        if "base" in results:
            succ = e2e.follows_successors(results["base"])
            check("base answers as the tiny model was built to", succ >= len(e2e.PROMPTS) - 1,
                  f"{succ}/{len(e2e.PROMPTS)}")
        for k in servers:
            ref = CASES[k]["ref"]
            if k in results and ref in results:
                cmp = e2e.compare(results[ref], results[k])
                summary["cases"][k]["vs_" + ref] = cmp
                check(f"{k}: greedy tokens equal {ref}'s", cmp["same_tokens"] == cmp["prompts"], cmp)
            if k in results and CASES[k]["method"] != "baseline":
                sp = summary["cases"][k].get("spec") or {}
                check(f"{k}: drafts counted in /metrics", bool(sp.get("drafts")), sp)
                if CASES[k]["method"] == "dflash" and sp.get("drafts"):
                    p0 = (sp.get("per_pos") or {}).get("0", 0.0) / sp["drafts"]
                    summary["cases"][k]["acceptance_position_0"] = round(p0, 3)
                    check(f"{k}: position 0 accepted as the drafter is built (>= 0.8)", p0 >= 0.8,
                          {"position_0": round(p0, 3), "per_pos": sp.get("per_pos"), "drafts": sp["drafts"]})
        save()
        runs = a.out / "runs"
        for k, label in ([] if a.no_bench else BENCH):
            if k not in results:
                continue
            s = servers[k]
            left = a.budget - (time.monotonic() - t0)
            if left < 40:
                check(f"bench {label} on {k}", False, f"no time left ({left:.0f} s)")
                continue
            had = set(runs.glob("*.json")) if runs.exists() else set()
            before = e2e.scrape(s)
            meta = {"speculative_config": json.loads(s.argv[s.argv.index("--speculative-config") + 1])
                    if "--speculative-config" in s.argv else None, "serve_argv": s.argv, "gpu": host["gpu"],
                    "vllm": host["vllm"]}
            r = e2e.run([sys.executable, str(e2e.ROOT / "scripts/bench.py"), "run", "--base-url", s.url,
                         "--model", "tiny", "--label", label, "--out", str(runs), "--warmup", "1",
                         "--max-tokens", str(a.max_tokens), "--category", "chat_qa,code",
                         "--concurrency", "1,2,4", "--quiet", "--meta-json", json.dumps(meta)],
                        timeout=max(30, left - 20))
            after = e2e.scrape(s)
            new = set(runs.glob("*.json")) - had if runs.exists() else set()
            docs = sorted(new, key=lambda p: p.stat().st_mtime)
            name = f"bench {label} on {k} (concurrency 1,2,4)"
            if r.returncode or not docs:
                check(name, False, (r.stdout + r.stderr)[-800:])
                continue
            figs = []
            for i, path in enumerate(docs):
                doc = json.loads(path.read_text())
                if "summary" not in doc:
                    continue
                sp, counters = doc.get("spec") or {}, doc.get("spec_counters") or {}
                med = lambda x: round(x["median"], 4) if isinstance(x, dict) and x.get("median") else None  # noqa: E731
                tel = doc.get("telemetry") or {}
                fig = {"file": path.name, "concurrency": (doc.get("meta") or {}).get("concurrency"),
                       "valid": doc.get("valid"), "problems": doc.get("problems"),
                       "requests": doc["summary"].get("requests"),
                       "decode_tok_s_median": med(doc["summary"].get("decode_tok_s")),
                       "ttft_s_median": med(doc["summary"].get("ttft_s")),
                       "acceptance_rate": sp.get("acceptance_rate"), "per_position": sp.get("per_position"),
                       "telemetry": {x: tel.get(x) for x in ("source", "power_w_mean", "j_per_output_token",
                                                             "temp_c_max", "sm_clock_mhz_min", "warnings")}
                       | {"samples": len(tel.get("samples") or [])}}
                if label != "baseline":
                    # our own scrapes bound the first and the last run; between two runs of one call
                    # nothing else asks the server, so the runs' own snapshots stand for ours
                    own = counters.get("after") or {}
                    b = before if i == 0 else {}
                    e = after if i == len(docs) - 1 else {e2e.DRAFTS: own.get(e2e.DRAFTS),
                                                          e2e.ACCEPTED: own.get(e2e.ACCEPTED),
                                                          "per_pos": own.get(e2e.PER_POS)}
                    fig["runner_vs_counters"] = e2e.runner_matches_counters(sp, counters, b, e)
                figs.append(fig)
            summary["bench"].setdefault(f"{label}@{k}", []).append(figs)
            ok = bool(figs) and all(f["valid"] for f in figs) and all(
                f.get("runner_vs_counters", {"ok": True})["ok"] for f in figs)
            check(name, ok, [{x: f.get(x) for x in ("concurrency", "valid", "decode_tok_s_median",
                                                     "acceptance_rate", "telemetry")}
                             | ({"runner_ok": f["runner_vs_counters"]["ok"]}
                                if "runner_vs_counters" in f else {})
                             for f in figs])
            save()
        if runs.exists() and not a.no_bench:
            rep = e2e.run([sys.executable, str(e2e.ROOT / "scripts/bench.py"), "report", str(runs), "--out",
                           str(a.out / "report"), "--no-charts"])
            check("report written", rep.returncode == 0 and (a.out / "report" / "report.md").exists(),
                  (rep.stdout + rep.stderr)[-400:])
    finally:  # summary.json however the run ends
        for s in servers.values():
            s.stop()
        save()
    print("DFLASH_BENCH SUMMARY " + json.dumps({"host": summary["host"], "failed": failures,
                                                "seconds": summary["seconds"]}), flush=True)
    return 1 if failures else 0


def last_line(text: str) -> str:
    """The last non-blank line of a log (a tqdm bar's carriage returns split too)."""
    lines = [ln for ln in re.split(r"[\r\n]+", text[-4000:]) if ln.strip()]
    return lines[-1][-200:] if lines else ""


def host_sample(t0: float) -> dict:
    """What the host is doing: ptxas/compiler processes, Triton cache entries, load average."""
    try:
        ps = subprocess.run(["ps", "-eo", "comm="], capture_output=True, text=True, timeout=5)
        comms = ps.stdout.split()
    except (OSError, subprocess.SubprocessError):
        comms = []
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return {"t": round(time.monotonic() - t0, 1), "ptxas": comms.count("ptxas"),
            "cc": sum(c in ("cc", "gcc", "cc1", "nvcc", "cicc") for c in comms),
            "triton_cache": len(list(cache.iterdir())) if cache.is_dir() else 0,
            "load": os.getloadavg()[0]}


if __name__ == "__main__":
    sys.exit(main())
