#!/usr/bin/env python3
"""Real GPU: first starts with CUDA graphs, FlashInfer attention, fastsafetensors, EAGLE-3.

    python3 tests/gpu/first_start.py --out DIR [--work DIR] [--budget S] [--cases a,b,...]
                                     [--flashinfer-cuda-home DIR]

On a host where ``import vllm`` works (vLLM 0.20.0 here), it builds our hybrid with our own
pipeline (e2e.build_models: tiny_pair.py, hybrid_merge.py, mtp_index_patch.py, verify_checkpoint.py),
applies patches/vllm-<version>/ to a copy of vLLM (e2e.patched_vllm) and starts, at once, one
patched server per case, each with the argv ``spark_serve_argv`` renders for its method and the
host's flags through the owners' knobs (e2e.HOST_SETTINGS; the cases below only change
``--enforce-eager``, the attention backend and the load format):

  eager-base     baseline, FLASH_ATTN, --enforce-eager           (the reference)
  eager-mtp      mtp, FLASH_ATTN, --enforce-eager
  graph-base     baseline, FLASH_ATTN, CUDA graphs (torch.compile + capture, vLLM's defaults)
  graph-mtp      mtp, FLASH_ATTN, CUDA graphs
  fi-graph-base  baseline, the catalogue's backend (FLASHINFER), CUDA graphs
  fi-graph-mtp   mtp, the catalogue's backend (FLASHINFER), CUDA graphs
  fst-base       baseline, FLASH_ATTN, --enforce-eager, --load-format fastsafetensors
  eager-eagle3   eagle3 with the tiny drafter of tiny_eagle3.py, FLASH_ATTN, --enforce-eager

Every server gets its own VLLM_CACHE_ROOT (no torch.compile cache shared or reused: each start is a
first start). FlashInfer compiles its kernels with nvcc at first use: ``--flashinfer-cuda-home``
names a CUDA tree with ``bin/nvcc`` (tests/gpu/cuda_home.sh assembles one from PyPI wheels) for the
fi-* servers. While the servers start, the log of each is read every half second and the first time
each phase line appears is recorded (PHASES); vLLM's own figures ("Loading weights took", "Graph
capturing finished in", ...) are taken from the same lines. Then each server that came up is asked
e2e.PROMPTS greedily (temperature 0, top-1 logprobs) and the checks compare tokens with the eager
reference of the same method, count drafts in /metrics, and compare the load times.

Writes DIR/summary.json, DIR/vllm-CASE.log (whole logs) and DIR/phases-CASE.log (the phase lines
only, with a header naming GPU, vLLM version, date and argv: what tests/fixtures/vllm_logs/ keeps).
Exit 0 every check passed, 1 one failed (named in the summary), 2 usage or no vLLM/GPU here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from spark_methods import SETTING_DEFAULTS, spark_serve_argv

from tests.gpu import e2e, tiny_eagle3

# (first-seen name, regex): the lines that mark a start's phases in vLLM 0.20.0 (and 0.26.0) logs
PHASES = [
    ("engine_core", r"Initializing a V1 LLM engine"),
    ("load_start", r"Starting to load model"),
    ("weights_loading", r"Loading safetensors (?:checkpoint shards|using Fastsafetensor)"),
    ("weights_loaded", r"Loading weights took"),
    ("model_loaded", r"Model loading took"),
    ("compile_start", r"Dynamo bytecode transform time|Using cache directory: .*torch\.compile"),
    ("compile_graph", r"Compiling a graph for compile range"),
    ("compile_done", r"torch\.compile takes [\d.]+ s in total"),
    ("kv_cache", r"GPU KV cache size"),
    ("graph_capture", r"Capturing CUDA graphs"),
    ("graph_capture_done", r"Graph capturing finished in"),
    ("engine_ready", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("api_ready", r"Application startup complete"),
]
# vLLM's own figures, every occurrence (a drafter loads its weights too)
FIGURES = {
    "loading_weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_loading_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "compile_graph_s": r"Compiling a graph for compile range .* takes ([\d.]+) s",
    "torch_compile_total_s": r"torch\.compile takes ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
# lines kept in a cut-down fixture beside the phase lines: backends chosen, the compile/capture
# sizes, FlashInfer's JIT, errors
KEEP = [r"Using (?:AttentionBackendEnum\.)?\w+ (?:attention )?backend\b", r"Using \S+ .*MoE backend",
        r"cudagraph|CUDAGraph|compile_sizes",
        r"[Ff]lash[Ii]nfer.*(?:JIT|[Cc]ompil|[Bb]uild|ninja|nvcc)", r"Traceback|\w+Error\b| ERROR ",
        r"Starting vLLM server", r"Loading drafter model", r"fastsafetensors|Fastsafetensor|GDS",
        r"Enforce eager|Cudagraph is disabled"]
PHASE_RE = [(n, re.compile(p)) for n, p in PHASES]
KEEP_RE = re.compile("|".join(p for _, p in PHASES) + "|" + "|".join(KEEP))
TQDM_CR = re.compile(r"[^\r\n]*\r")

FI = "FLASHINFER"
CASES = {
    "eager-base": {"method": "baseline", "eager": True, "ref": None},
    "eager-mtp": {"method": "mtp", "eager": True, "ref": "eager-base"},
    "graph-base": {"method": "baseline", "eager": False, "ref": "eager-base"},
    "graph-mtp": {"method": "mtp", "eager": False, "ref": "eager-mtp"},
    "fi-graph-base": {"method": "baseline", "eager": False, "backend": "catalogue", "ref": "eager-base"},
    "fi-graph-mtp": {"method": "mtp", "eager": False, "backend": "catalogue", "ref": "eager-mtp"},
    "fst-base": {"method": "baseline", "eager": True, "load_format": "fastsafetensors", "ref": "eager-base"},
    "eager-eagle3": {"method": "eagle3", "eager": True, "ref": "eager-base"},
}


def log(msg: str) -> None:
    print(f"[first_start {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def case_settings(case: dict, model: str, port: int, drafter: str | None) -> dict:
    """The owner settings of one case: e2e's host knobs, minus --enforce-eager where graphs are
    wanted, the catalogue's attention backend where asked, the load format where asked."""
    extra = list(e2e.HOST_SETTINGS["vllm_serve_extra_args"])
    if not case["eager"]:
        extra.remove("--enforce-eager")
    s = dict(SETTING_DEFAULTS, spec_method=case["method"], vllm_model_path=model, vllm_port=port,
             **e2e.TEST_OVERRIDES)
    s["vllm_serve_extra_args"] = extra
    s["vllm_attention_backend"] = "" if case.get("backend") == "catalogue" else \
        e2e.HOST_SETTINGS["vllm_attention_backend"]
    if case.get("load_format"):
        s["vllm_load_format"] = case["load_format"]
    if case["method"] == "eagle3":
        s["spec_eagle3_drafter"] = drafter
    return s


def phase_times(text: str, seen: dict[str, float], now: float) -> None:
    """Record, for each phase not seen yet, ``now`` if its line is in ``text``."""
    for name, rx in PHASE_RE:
        if name not in seen and rx.search(text):
            seen[name] = round(now, 1)


def figures(text: str) -> dict:
    return {k: [float(x) for x in re.findall(p, text)] for k, p in FIGURES.items()}


def phase_spans(seen: dict[str, float]) -> dict:
    """Durations between the first-seen times (our clock, from the process start)."""
    def span(a: str, b: str) -> float | None:
        return round(seen[b] - seen[a], 1) if a in seen and b in seen else None
    return {"to_engine_core": seen.get("engine_core"), "load": span("weights_loading", "model_loaded"),
            "compile": span("model_loaded", "kv_cache"),
            "graph_capture": span("graph_capture", "engine_ready"),
            "engine_ready_to_api": span("engine_ready", "api_ready"), "total": seen.get("api_ready")}


def cut_log(text: str, header: str) -> str:
    """The phase lines (and backend/compile/error lines) of a start log, tqdm redraws collapsed."""
    lines = [header.rstrip("\n")]
    for ln in TQDM_CR.sub("", text).splitlines():
        if KEEP_RE.search(ln):
            lines.append(ln.rstrip()[:400])
    return "\n".join(lines) + "\n"


def spec_counts(server: e2e.Server) -> dict:
    m = e2e.scrape(server)
    return {"drafts": m.get(e2e.DRAFTS), "draft_tokens": m.get(e2e.DRAFT_TOKENS),
            "accepted": m.get(e2e.ACCEPTED), "per_pos": m.get("per_pos"),
            "acceptance": e2e.acceptance(m)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="first_start.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results: logs, cut-down logs, summary.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-first-start"),
                    help="scratch directory (default /tmp/sparkllm-first-start)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole run (default 480)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--ref-dir", type=Path,
                    help="probe-CASE.json of an earlier run, for references not started in this one")
    ap.add_argument("--flashinfer-cuda-home", type=Path, help="CUDA tree with bin/nvcc for the fi-* servers")
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        print(f"first_start.py: unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if a.flashinfer_cuda_home and not (a.flashinfer_cuda_home / "bin" / "nvcc").is_file():
        print(f"first_start.py: {a.flashinfer_cuda_home}/bin/nvcc does not exist; run tests/gpu/cuda_home.sh "
              "or leave --flashinfer-cuda-home out", file=sys.stderr)
        return 2
    rec = e2e.Record(a.out, a.work, log, cases={})
    t0, summary, failures, check = rec.t0, rec.summary, rec.failures, rec.check
    host = rec.host("first_start.py")
    if host is None:
        return 2
    models = e2e.build_models(a.work)
    summary["pipeline_verify_ok"] = models["verify"]["ok"]
    patched, pp = rec.patched(a.work, host)
    drafter = None
    if "eager-eagle3" in names:
        hybrid_dir = Path(models["dirs"]["hybrid"])
        drafter = tiny_eagle3.generate(a.work / "eagle3", tokenizer_from=hybrid_dir)["path"]
    servers: dict[str, e2e.Server] = {}
    for i, name in enumerate(names):
        case = CASES[name]
        s = e2e.Server(name, "baseline", models["dirs"]["hybrid"], 8201 + i, pp, a.out)  # argv below
        s.method = case["method"]
        s.argv = spark_serve_argv(case_settings(case, models["dirs"]["hybrid"], 8201 + i, drafter),
                                  e2e.load_catalogue())
        s.env["VLLM_CACHE_ROOT"] = str(a.work / f"vllm-cache-{name}")
        if case.get("backend") == "catalogue" and a.flashinfer_cuda_home:
            home = str(a.flashinfer_cuda_home)
            s.env.update(CUDA_HOME=home, PATH=f"{home}/bin:{s.env.get('PATH', '')}",
                         FLASHINFER_CUDA_ARCH_LIST="9.0a",
                         FLASHINFER_WORKSPACE_BASE=str(a.work / "flashinfer-ws"))
        servers[name] = s
    for s in servers.values():
        s.start()
    log("started " + ", ".join(f"{k}:{s.port}" for k, s in servers.items()))
    seen: dict[str, dict[str, float]] = {k: {} for k in servers}
    deadline = t0 + a.budget - 90
    states = {k: "starting" for k in servers}
    try:
        while time.monotonic() < deadline:
            for k, s in servers.items():
                if states[k] == "starting":
                    phase_times(s.log_text(), seen[k], time.monotonic() - s.t0)
                    states[k] = s.poll()
            if all(v != "starting" for v in states.values()):
                break
            time.sleep(0.5)
        for k, s in servers.items():
            text = s.log_text()
            phase_times(text, seen[k], time.monotonic() - s.t0)
            last = [ln[:300] for ln in TQDM_CR.sub("", text).splitlines() if ln.strip()][-6:]
            errors = [ln[:400] for ln in text.splitlines() if re.search(r"Error|error:|Traceback", ln)][-8:]
            summary["cases"][k] = {"state": states[k], "exit_code": s.exit_code, "argv": s.argv,
                                   "ready_s": None if s.healthy_after is None else round(s.healthy_after, 1),
                                   "first_seen_s": seen[k], "spans_s": phase_spans(seen[k]),
                                   "vllm_figures": figures(text),
                                   "last_lines": last if states[k] != "up" else [], "errors": errors}
            header = (f"# cut from a real first start: {host['gpu']}, vLLM {host['vllm']}, "
                      f"torch {host['torch']}, "
                      f"{summary['host']['date']}, case {k} ({states[k]}); argv: vllm serve "
                      + " ".join(s.argv))
            (a.out / f"phases-{k}.log").write_text(cut_log(text, header))
        log("states: " + json.dumps({k: (v, summary["cases"][k]["ready_s"]) for k, v in states.items()}))
        results = {}
        for k, s in servers.items():
            if states[k] == "up":
                try:
                    results[k] = e2e.probe(s)
                    (a.out / f"probe-{k}.json").write_text(json.dumps(results[k], indent=1))
                    if CASES[k]["method"] != "baseline":
                        summary["cases"][k]["spec"] = spec_counts(s)
                except (OSError, ValueError, KeyError) as e:
                    summary["cases"][k]["probe_error"] = f"{type(e).__name__}: {e}"
        for k in servers:
            check(f"{k} serves", k in results,
                  {x: summary["cases"][k][x] for x in ("state", "ready_s", "exit_code")})
        if "eager-base" in results:
            succ = e2e.follows_successors(results["eager-base"])
            check("eager-base answers as the tiny model was built to", succ >= len(e2e.PROMPTS) - 1,
                  f"{succ}/{len(e2e.PROMPTS)}")
        refs = dict(results)
        for k in servers:
            ref = CASES[k]["ref"]
            if ref and ref not in refs and a.ref_dir and (a.ref_dir / f"probe-{ref}.json").is_file():
                refs[ref] = json.loads((a.ref_dir / f"probe-{ref}.json").read_text())
                summary.setdefault("refs_from_earlier_run", []).append(ref)
            if k in results and ref in refs:
                cmp = e2e.compare(refs[ref], results[k])
                summary["cases"][k]["vs_" + ref] = cmp
                check(f"{k}: greedy tokens equal {ref}'s", cmp["same_tokens"] == cmp["prompts"], cmp)
            if k in results and CASES[k]["method"] != "baseline":
                sp = summary["cases"][k].get("spec") or {}
                check(f"{k}: drafts counted in /metrics", bool(sp.get("drafts")), sp)
        for k in ("graph-base", "graph-mtp", "fi-graph-base", "fi-graph-mtp"):
            if k in servers:
                f = summary["cases"][k]["vllm_figures"]
                check(f"{k}: CUDA graphs captured (phase line seen)", bool(f["graph_capture_s"]),
                      {"graph_capture_s": f["graph_capture_s"], "first_seen_s": seen[k]})
        for k in ("fi-graph-base", "fi-graph-mtp"):
            if k in servers:
                text = servers[k].log_text()
                m = re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend\b", text)
                check(f"{k}: the catalogue's FLASHINFER attention backend in use",
                      bool(m) and set(m) == {FI}, m)
        if "fst-base" in servers and "eager-base" in servers:
            fst = summary["cases"]["fst-base"]["vllm_figures"]["loading_weights_s"]
            st = summary["cases"]["eager-base"]["vllm_figures"]["loading_weights_s"]
            summary["load_time_s"] = {"safetensors": st, "fastsafetensors": fst}
            used = "Fastsafetensor" in servers["fst-base"].log_text()
            check("fst-base: weights loaded by fastsafetensors", used and bool(fst), summary["load_time_s"])
    finally:  # summary.json however the run ends
        for s in servers.values():
            s.stop()
        rec.save()
    print("FIRST_START SUMMARY " + json.dumps({"host": summary["host"], "failed": failures,
                                               "seconds": summary["seconds"]}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
