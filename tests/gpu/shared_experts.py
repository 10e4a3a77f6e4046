#!/usr/bin/env python3
"""Real GPU: a hybrid whose FP8 shared experts are wrong must FAIL our hybrid check; and vLLM reserves
what the memory budget says it does.

    python3 tests/gpu/shared_experts.py --out DIR [--work DIR] [--budget S] [--moe-backend auto|NAME]
                                        [--phase all|shared|memory]

On a host where ``import vllm`` works (0.20.0 or 0.26.0: tests/gpu/gpu_host.sh), with our patches applied
to a copy of it (e2e.patched_vllm):

1. Negative control (issue 34). ``tiny_pair.py --shared-experts-matter`` builds a pair whose greedy text
   follows the successor map only through the last layer's shared experts (without them a decoy answer
   wins; tests/unit/test_tiny_pair.py holds the arithmetic). Our pipeline merges it; a copy with every
   shared-expert ``weight_scale_inv`` x 1/16 is the shared experts removed. Three baseline servers:
   ``sm-int4`` (Intel's INT4 layout, shared experts BF16: the reference), ``sm-hybrid`` (ours) and
   ``sm-neg`` (the 1/16 copy). Checks: the reference answers as built; ours tracks it (same greedy
   tokens, top-1 logprobs within e2e.LOGPROB_TOL); the negative control does NOT (so the check can fail);
   verify_checkpoint.py --fp8-source accepts ours and refuses the copy.
2. Memory reservation (issue 29). One baseline server at ``--gpu-memory-utilization MEM_UTIL`` without
   e2e's fixed KV-cache size: the GPU memory its processes hold (nvidia-smi) against the budget's
   prediction, total x utilization; then, while it runs, a second one asking for more than is free must
   be refused at start with vLLM's own free-memory message (v1/worker/utils.py request_memory).

Writes DIR/summary.json and DIR/vllm-CASE.log. Exit 0 every check passed, 1 one failed, 2 usage or no
vLLM/GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from spark_methods import spark_serve_argv

from tests.gpu import e2e, tiny_pair
from tests.gpu import first_start as fs

log = e2e.logger("shared_experts")

MEM_UTIL = 0.30
OVER_UTIL = 0.80  # more than is free while the MEM_UTIL server holds its share


def gpu_memory() -> dict:
    """nvidia-smi's total (MiB) and the MiB held per process id."""
    q = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    held = {}
    for line in apps.stdout.splitlines():
        if "," in line:
            pid, mib = (x.strip() for x in line.split(",", 1))
            held[int(pid)] = int(mib)
    return {"total_mib": int(q.stdout.split()[0]), "held_mib": held}


def session_pids(leader: int) -> set[int]:
    """The server's process group (API server, engine core, workers: start_new_session=True)."""
    out = subprocess.run(["ps", "-eo", "pid,pgid"], capture_output=True, text=True, check=True).stdout
    return {int(p) for p, g in (ln.split() for ln in out.splitlines()[1:]) if int(g) == leader}


def wait_up(servers: dict, deadline: float) -> dict:
    while time.monotonic() < deadline:
        states = {k: s.poll() for k, s in servers.items()}
        if all(v != "starting" for v in states.values()):
            return states
        time.sleep(1)
    return {k: s.poll() for k, s in servers.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shared_experts.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-shared"))
    ap.add_argument("--budget", type=float, default=570, help="seconds for the whole run (default 570)")
    ap.add_argument("--moe-backend", default="auto", help="the host's --moe-backend, or auto: no flag")
    ap.add_argument("--phase", choices=("all", "shared", "memory"), default="all",
                    help="run both parts, or one of them in its own call (default all)")
    a = ap.parse_args(argv)
    rec = e2e.Record(a.out, a.work, log, cases={})
    t0, summary, failures, check, save = rec.t0, rec.summary, rec.failures, rec.check, rec.save
    host = rec.host("shared_experts.py")
    if host is None:
        return 2
    py = sys.executable
    pair = tiny_pair.generate(a.work / "pair", shared_matter=True)
    hybrid = a.work / "hybrid"
    r = e2e.run(
        [
            py,
            str(e2e.ROOT / "scripts/hybrid_merge.py"),
            "--int4",
            pair["int4"],
            "--fp8",
            pair["fp8"],
            "--out",
            str(hybrid),
        ]
    )
    if r.returncode:
        raise SystemExit(f"hybrid_merge.py failed: {r.stderr or r.stdout}")
    neg = tiny_pair.scaled_shared_experts(hybrid, a.work / "hybrid-shared-1-16", 1 / 16)
    verify = [
        py,
        str(e2e.ROOT / "scripts/verify_checkpoint.py"),
        "--expect-hybrid",
        "--fp8-source",
        pair["fp8"],
    ]
    ours, theirs = e2e.run([*verify, str(hybrid)]), e2e.run([*verify, neg["path"]])
    check(
        "verify_checkpoint --fp8-source accepts our hybrid and refuses the 1/16 copy",
        ours.returncode == 0 and theirs.returncode == 1,
        {"ours": ours.returncode, "copy": theirs.returncode, "copy_first_line": theirs.stdout.split("\n")[0]},
    )
    patched, pp = rec.patched(a.work, host)
    catalogue = e2e.load_catalogue()

    def server(label: str, model: str, port: int, util: float | None = None) -> e2e.Server:
        s = e2e.Server(label, "baseline", model, port, pp, a.out)
        settings = fs.case_settings({"method": "baseline", "eager": True}, model, port, None)
        extra = settings["vllm_serve_extra_args"]
        i = extra.index("--moe-backend")
        if a.moe_backend == "auto":
            del extra[i : i + 2]
        else:
            extra[i + 1] = a.moe_backend
        if util is not None:  # vLLM sizes the KV cache from the utilization, as on a Spark
            i = extra.index("--kv-cache-memory-bytes")
            del extra[i : i + 2]
            settings["vllm_gpu_memory_utilization"] = util
        s.argv = spark_serve_argv(settings, catalogue)
        summary["cases"][label] = {"argv": s.argv}
        return s

    servers = {} if a.phase == "memory" else {
        "sm-int4": server("sm-int4", pair["int4"], 8401),
        "sm-hybrid": server("sm-hybrid", str(hybrid), 8402),
        "sm-neg": server("sm-neg", neg["path"], 8403),
    }
    reserve = 200 if a.phase == "all" else 30  # seconds kept for what follows (the memory part, the probes)
    states: dict = {}
    try:
        # the first start compiles the Triton kernels (minutes on a cold host); the other two then find
        # them in the on-disk caches instead of compiling the same kernels three times at once
        if servers:
            servers["sm-int4"].start()
            wait_up({"sm-int4": servers["sm-int4"]}, t0 + a.budget - reserve - 60)
            for k in ("sm-hybrid", "sm-neg"):
                servers[k].start()
            states = wait_up(servers, t0 + a.budget - reserve)
        results = {}
        for k, s in servers.items():
            summary["cases"][k].update(state=states[k], ready_s=s.healthy_after, exit_code=s.exit_code)
            if states[k] == "up":
                results[k] = e2e.probe(s)
                (a.out / f"probe-{k}.json").write_text(json.dumps(results[k], indent=1))
            check(f"{k} serves", k in results, summary["cases"][k].get("state"))
        if "sm-int4" in results:
            succ = e2e.follows_successors(results["sm-int4"])
            check(
                "sm-int4 answers as the tiny model was built to",
                succ >= len(e2e.PROMPTS) - 1,
                f"{succ}/{len(e2e.PROMPTS)}",
            )
        for k, must in (("sm-hybrid", True), ("sm-neg", False)):
            if k in results and "sm-int4" in results:
                cmp = e2e.compare(results["sm-int4"], results[k])
                tracks = (
                    cmp["same_tokens"] == cmp["prompts"]
                    and cmp["max_abs_logprob_diff"] is not None
                    and cmp["max_abs_logprob_diff"] <= e2e.LOGPROB_TOL
                )
                summary["cases"][k]["vs_int4"] = cmp
                name = (
                    "our hybrid tracks the INT4 checkpoint"
                    if must
                    else "negative control: the 1/16 shared experts FAIL the same check"
                )
                check(name, tracks is must, cmp)
    finally:  # summary.json however the phase ends
        for s in servers.values():
            s.stop()
        save()

    # 2. memory reservation, one server alone, then one asking for more than is free
    left = a.budget - (time.monotonic() - t0)
    if a.phase == "shared":
        save()
        log(f"done in {summary['seconds']} s; failed: {failures or 'none'}")
        return 1 if failures else 0
    if left < 150:
        check("memory: reservation measured", False, f"no time left ({left:.0f} s)")
        save()
        return 1 if failures else 0
    mem = {"mem": server("mem", str(hybrid), 8411, util=MEM_UTIL)}
    over = {"mem-over": server("mem-over", str(hybrid), 8412, util=OVER_UTIL)}
    try:
        mem["mem"].start()
        states = wait_up(mem, time.monotonic() + min(240, left - 90))
        if states["mem"] != "up":
            check("memory: the server at MEM_UTIL serves", False, states)
        else:
            g = gpu_memory()
            pids = session_pids(mem["mem"].proc.pid)
            held = sum(m for p, m in g["held_mib"].items() if p in pids)
            predicted = g["total_mib"] * MEM_UTIL
            detail = {
                "total_mib": g["total_mib"],
                "utilization": MEM_UTIL,
                "predicted_mib": round(predicted),
                "held_mib": held,
                "ratio": round(held / predicted, 4) if predicted else None,
                "kv_cache": fs.figures(mem["mem"].log_text()),
            }
            summary["memory"] = detail
            check(
                "memory: vLLM holds total x utilization (within 5 %)",
                abs(held / predicted - 1) <= 0.05,
                detail,
            )
            over["mem-over"].start()
            states = wait_up(over, time.monotonic() + min(180, a.budget - (time.monotonic() - t0) - 20))
            text = over["mem-over"].log_text()
            refused = states["mem-over"] == "dead" and "is less than desired GPU memory utilization" in text
            line = next((ln for ln in text.splitlines() if "Free memory on device" in ln), None)
            summary["memory"]["over"] = {
                "utilization": OVER_UTIL,
                "state": states["mem-over"],
                "message": line,
            }
            check(
                "memory: a start asking for more than is free is refused with vLLM's message",
                refused,
                summary["memory"]["over"],
            )
    finally:  # summary.json however the run ends
        for s in (*mem.values(), *over.values()):
            s.stop()
        save()
    log(f"done in {summary['seconds']} s; failed: {failures or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
