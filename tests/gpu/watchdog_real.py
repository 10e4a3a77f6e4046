#!/usr/bin/env python3
"""Real GPU: the progress watchdog (scripts/ops_watchdog.py) against a real vLLM server.

    python3 tests/gpu/watchdog_real.py --out DIR [--work DIR] [--budget S] [--standin FIXTURES_DIR]

On a host where ``import vllm`` works (vLLM 0.20.0 here), it builds the tiny random Llama
(``tiny_llama.py``, beside the watchdog copy in .gpuwork/wd/, else ../shared/gpu/), starts ``vllm serve`` with
``--max-num-seqs 2 --api-key KEY --enforce-eager`` and runs the watchdog as its timer would: a fresh
process every --interval seconds, with a state file kept between runs and a fake ``systemctl``
(``--systemctl``) that says the unit is active and records every call. Cases:

  c   wrong key: the watchdog's key file holds another key; the idle server's one-token probe gets 401:
      one CONFIGURATION ERROR line, no restart; then the right key clears it ("configuration error is
      gone"); a missing key file is one line too;
  a   busy: max_num_seqs streams with long max_tokens running and one more waiting, kept so for
      --busy seconds: the watchdog never fails, never restarts;
  b   engine stopped while busy: SIGSTOP the EngineCore process (its /health still answers 200): the
      watchdog restarts the unit within --stall + --failures runs;
  b2  engine stopped while idle (after SIGCONT and the streams aborted): the one-token probe times
      out, --failures runs restart the unit (only when the budget allows).

The watchdog is taken from .gpuwork/wd/ops_watchdog.py (a copy of the version under test, with
sparkllm/__init__.py and sparkllm/cli.py beside it, as role spark_ops installs it), else
scripts/ops_watchdog.py. ``--standin DIR``: run against tests/fixtures/standin_server in DIR instead
(no GPU; the engine "stop" is its STANDIN_ENGINE_WEDGE_FILE), to test this script itself.
Writes DIR/summary.json (checks, each watchdog run's verdict and journal lines, systemctl calls,
/health codes, timings), DIR/vllm.log, DIR/watchdog-runs.log. Exit 0 all checks passed, 1 not.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from tests.gpu.watchdog_load import T0, Load, http_get, log, metrics, post_json, short_metrics  # noqa: E402


def watchdog_path() -> Path:
    p = ROOT / ".gpuwork/wd/ops_watchdog.py"
    return p if p.exists() else ROOT / "scripts/ops_watchdog.py"


# ------------------------------------------------------------------ the watchdog under its fake timer
FAKE_SYSTEMCTL = """#!/bin/sh
# fake systemctl: records each call; `show` prints the unit's properties from $FAKE_SYSTEMCTL_PROPS
echo "$(date +%s.%N) $*" >> "$FAKE_SYSTEMCTL_LOG"
case "$1" in
  show) cat "$FAKE_SYSTEMCTL_PROPS" ;;
esac
exit 0
"""


class Watchdog:
    def __init__(self, work: Path, url: str, unit: str, a: argparse.Namespace, runs_log: Path):
        self.work, self.url, self.unit, self.a = work, url, unit, a
        self.path = watchdog_path()
        self.systemctl = work / "systemctl"
        self.systemctl.write_text(FAKE_SYSTEMCTL)
        self.systemctl.chmod(0o755)
        self.calls = work / "systemctl-calls.log"
        self.calls.write_text("")
        self.props = work / "unit-props"
        self.runs_log = runs_log

    def set_unit(self, active_enter_monotonic: float, invocation: str) -> None:
        self.props.write_text(
            f"ActiveState=active\nInvocationID={invocation}\n"
            f"ActiveEnterTimestampMonotonic={int(active_enter_monotonic * 1e6)}\n"
        )

    def calls_list(self) -> list[dict]:
        out = []
        for line in self.calls.read_text().splitlines():
            t, _, args = line.partition(" ")
            out.append({"t_s": round(float(t) - T0, 2), "args": args})
        return out

    def control_calls(self) -> list[dict]:
        return [c for c in self.calls_list() if not c["args"].startswith("show ")]

    def run(self, case: str, state: Path, key_file: Path | None) -> dict:
        argv = [
            sys.executable,
            str(self.path),
            "--unit",
            self.unit,
            "--url",
            self.url,
            "--state",
            str(state),
            "--failures",
            str(self.a.failures),
            "--stall",
            str(self.a.stall),
            "--timeout",
            str(self.a.timeout),
            "--max-restarts",
            "3",
            "--window",
            "3600",
            "--completion-model",
            self.a.model_name,
            "--systemctl",
            str(self.systemctl),
            "--timer",
            "sparkllm-watchdog.timer",
        ]
        if key_file is not None:
            argv += ["--api-key-file", str(key_file)]
        env = {**os.environ, "FAKE_SYSTEMCTL_LOG": str(self.calls), "FAKE_SYSTEMCTL_PROPS": str(self.props)}
        n_before = len(self.control_calls())
        t = time.time()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, str(exc.stdout or ""), "TIMEOUT"
        dur = time.time() - t
        try:
            last = json.loads(state.read_text()).get("last") or {}
        except (OSError, ValueError):
            last = {}
        new_calls = self.control_calls()[n_before:]
        rec = {
            "case": case,
            "t_s": round(t - T0, 2),
            "seconds": round(dur, 2),
            "rc": rc,
            "journal": out.splitlines(),
            "stderr": err.strip().splitlines()[-5:],
            "verdict": last.get("kind"),
            "reason": last.get("reason"),
            "systemctl": [c["args"] for c in new_calls],
        }
        with self.runs_log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log(
            f"watchdog[{case}] rc={rc} {dur:.1f}s {last.get('kind')}: {last.get('reason')}"
            + (f" | journal: {' / '.join(out.splitlines())}" if out.strip() else "")
            + (f" | systemctl: {[c['args'] for c in new_calls]}" if new_calls else "")
        )
        return rec


# ------------------------------------------------------------------ server
def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def proc_desc(pid: int) -> dict:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        )
    except OSError:
        comm, cmd = "", ""
    return {"pid": pid, "comm": comm, "cmdline": cmd[:200]}


def engine_core_pid(server_pid: int) -> tuple[int | None, list[dict]]:
    cands = [proc_desc(p) for p in descendants(server_pid)]
    for c in cands:
        if "EngineCore" in c["comm"] or "EngineCore" in c["cmdline"]:
            return c["pid"], cands
    spawn = [c for c in cands if "spawn_main" in c["cmdline"]]
    return (spawn[0]["pid"] if len(spawn) == 1 else None), cands


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-watchdog-real"))
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole run (default 480)")
    ap.add_argument("--start-timeout", type=float, default=330)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=3900)
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between watchdog runs (its timer)")
    ap.add_argument("--busy", type=float, default=45.0, help="seconds of case a")
    ap.add_argument("--stall", type=float, default=20.0)
    ap.add_argument("--failures", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--model-name", default="tiny")
    ap.add_argument(
        "--standin",
        type=Path,
        default=None,
        help="tests/fixtures dir holding standin_server: run against the stand-in (no GPU)",
    )
    a = ap.parse_args(argv)
    deadline = T0 + a.budget
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    runs_log = a.out / "watchdog-runs.log"
    runs_log.write_text("")
    wd_path = watchdog_path()
    summary: dict = {
        "what": "progress watchdog (ops_watchdog.py) against a real vLLM: busy at max_num_seqs, "
        "engine stopped (SIGSTOP), wrong API key",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": "standin" if a.standin else "vllm",
        "watchdog": {
            "path": str(wd_path.relative_to(ROOT)),
            "sha256": hashlib.sha256(wd_path.read_bytes()).hexdigest(),
        },
        "params": {
            k: getattr(a, k)
            for k in (
                "max_num_seqs",
                "max_tokens",
                "interval",
                "busy",
                "stall",
                "failures",
                "timeout",
                "budget",
            )
        },
        "checks": [],
        "cases": {},
        "timings": {},
    }
    checks = summary["checks"]

    def check(name: str, ok: bool, detail: object = None) -> bool:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        log(f"CHECK {'PASS' if ok else 'FAIL'}: {name} {'' if detail is None else json.dumps(detail)[:300]}")
        return ok

    def write_summary() -> None:
        summary["passed"] = bool(checks) and all(c["ok"] for c in checks)
        summary["timings"]["total_s"] = round(time.time() - T0, 1)
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    for dist in ("vllm", "torch", "transformers", "triton", "flashinfer-python"):
        try:
            summary.setdefault("versions", {})[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            summary.setdefault("versions", {})[dist] = None
    summary["versions"]["python"] = sys.version.split()[0]
    try:
        summary["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        summary["gpu"] = None

    key = "sk-right-" + secrets.token_hex(8)
    key_right, key_wrong = a.work / "key-right", a.work / "key-wrong"
    key_right.write_text(key + "\n")
    key_wrong.write_text("sk-wrong-" + secrets.token_hex(8) + "\n")
    key_missing = a.work / "no-such-key-file"
    host, port = "127.0.0.1", a.port
    url = f"http://{host}:{port}"
    wedge = a.work / "engine-wedge"
    wedge.unlink(missing_ok=True)

    # ---- model + server
    env = dict(os.environ)
    if a.standin:
        argv_s = [
            sys.executable,
            "-m",
            "standin_server",
            "serve",
            "tiny-model",
            "--port",
            str(port),
            "--served-model-name",
            a.model_name,
            "--max-num-seqs",
            str(a.max_num_seqs),
        ]
        env.update(
            PYTHONPATH=str(a.standin),
            VLLM_API_KEY=key,
            STANDIN_QUEUE_AT_MAX_NUM_SEQS="1",
            STANDIN_ENGINE_WEDGE_FILE=str(wedge),
        )
    else:
        model = a.work / "tiny-llama"
        if not (model / "config.json").exists():
            t = time.time()
            builder = wd_path.parent / "tiny_llama.py"  # beside the copy under test, else the shared one
            if not builder.exists():
                builder = ROOT.parent / "shared" / "gpu" / "tiny_llama.py"
            b = subprocess.run(
                [sys.executable, str(builder), str(model)], capture_output=True, text=True, timeout=300
            )
            summary["timings"]["build_s"] = round(time.time() - t, 1)
            log(
                f"build rc={b.returncode}: {b.stdout.strip()[-200:]} "
                f"{b.stderr.strip()[-500:] if b.returncode else ''}"
            )
            if b.returncode:
                check("tiny Llama built", False, b.stderr[-2000:])
                write_summary()
                return 1
        argv_s = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(model),
            "--served-model-name",
            a.model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--gpu-memory-utilization",
            "0.3",
            "--enforce-eager",
            "--api-key",
            key,
        ]
    summary["server_argv"] = [x if x != key else "<key>" for x in argv_s]
    with socket.socket() as probe_sock:
        if probe_sock.connect_ex((host, port)) == 0:
            check(f"port {port} is free before the server starts", False, "something already listens there")
            write_summary()
            return 1
    vlog = (a.out / "vllm.log").open("w")
    t_srv = time.time()
    srv = subprocess.Popen(argv_s, stdout=vlog, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    active_enter = time.monotonic()
    log(f"server pid {srv.pid}: {' '.join(summary['server_argv'])}")

    wd = Watchdog(a.work, url, "sparkllm-vllm-baseline.service", a, runs_log)
    wd.set_unit(active_enter, secrets.token_hex(16))
    load: Load | None = None
    engine_pid: int | None = None

    def tick_health() -> int | None:
        return http_get(url + "/health", timeout=3)[0]

    try:
        ready = False
        limit = min(t_srv + a.start_timeout, deadline - 90)
        while time.time() < limit:
            if srv.poll() is not None:
                break
            if tick_health() == 200 and srv.poll() is None:
                ready = True
                break
            time.sleep(1)
        summary["timings"]["server_ready_s"] = round(time.time() - t_srv, 1) if ready else None
        if not check(
            "server answers /health 200",
            ready,
            {"after_s": summary["timings"]["server_ready_s"], "exit": srv.poll()},
        ):
            return 1
        st, ver = http_get(url + "/version")
        summary["server_version"] = ver.strip()[:200] if st == 200 else None
        t = time.time()
        w = post_json(
            url + "/v1/completions",
            {"model": a.model_name, "max_tokens": 8, "prompt": "hello"},
            key,
            timeout=120,
        )
        summary["timings"]["warmup_request_s"] = round(time.time() - t, 2)
        log(f"warm-up request HTTP {w[0]} in {time.time() - t:.1f}s")
        if not a.standin:
            engine_pid, cands = engine_core_pid(srv.pid)
            summary["engine_core"] = {"pid": engine_pid, "processes": cands}
            check("EngineCore process found", engine_pid is not None, {"pid": engine_pid, "processes": cands})

        def stop_engine() -> None:
            if a.standin:
                wedge.write_text("x")
            elif engine_pid:
                os.kill(engine_pid, signal.SIGSTOP)

        def cont_engine() -> None:
            if a.standin:
                wedge.unlink(missing_ok=True)
            elif engine_pid:
                os.kill(engine_pid, signal.SIGCONT)

        # ---- case c: wrong key / missing key / right key again
        try:
            c: dict = {"runs": []}
            summary["cases"]["c_wrong_key"] = c
            state_c = a.work / "state-c.json"
            state_c.unlink(missing_ok=True)
            n0 = len(wd.control_calls())
            c["unauthorized_probe_status"] = post_json(
                url + "/v1/completions",
                {"model": a.model_name, "prompt": "ping", "max_tokens": 1},
                key_wrong.read_text().strip(),
                10,
            )[0]
            for _ in range(4):
                c["runs"].append(wd.run("c-wrong", state_c, key_wrong))
                time.sleep(a.interval)
            cfg_lines = [ln for r in c["runs"] for ln in r["journal"] if "CONFIGURATION ERROR" in ln]
            all_lines = [ln for r in c["runs"] for ln in r["journal"]]
            check(
                "c: a wrong key is answered 401 by the server",
                c["unauthorized_probe_status"] == 401,
                c["unauthorized_probe_status"],
            )
            check(
                "c: wrong key -> exactly one CONFIGURATION ERROR journal line over 4 runs",
                len(cfg_lines) == 1 and len(all_lines) == 1,
                all_lines,
            )
            check(
                "c: wrong key -> every verdict 'config', rc 0",
                all(r["verdict"] == "config" and r["rc"] == 0 for r in c["runs"]),
                [(r["verdict"], r["rc"]) for r in c["runs"]],
            )
            check(
                "c: the line names the key file and HTTP 401",
                bool(cfg_lines) and "401" in cfg_lines[0] and str(key_wrong) in cfg_lines[0],
                cfg_lines[:1],
            )
            right = wd.run("c-right", state_c, key_right)
            c["runs"].append(right)
            check(
                "c: the right key afterwards -> ok, 'configuration error is gone'",
                right["verdict"] == "ok"
                and any("configuration error is gone" in ln for ln in right["journal"]),
                right["journal"],
            )
            state_m = a.work / "state-c-missing.json"
            state_m.unlink(missing_ok=True)
            miss = [wd.run("c-missing", state_m, key_missing) for _ in range(2)]
            c["runs"] += miss
            mlines = [ln for r in miss for ln in r["journal"]]
            check(
                "c: a missing key file -> one line, no traceback",
                len(mlines) == 1 and "cannot read" in mlines[0] and not any(r["stderr"] for r in miss),
                {"journal": mlines, "stderr": [r["stderr"] for r in miss]},
            )
            c["control_calls"] = wd.control_calls()[n0:]
            check("c: no restart or stop", not c["control_calls"], c["control_calls"])
        except Exception as exc:
            check("c: ran", False, f"{type(exc).__name__}: {exc}")

        # ---- case a: busy at max_num_seqs plus one waiting
        state_ab = a.work / "state-ab.json"
        state_ab.unlink(missing_ok=True)
        try:
            ca: dict = {"runs": [], "ticks": []}
            summary["cases"]["a_busy"] = ca
            n0 = len(wd.control_calls())
            # the stand-in streams only chat; vLLM: plain completions (no chat template involved)
            load = Load(host, port, key, a.model_name, a.max_tokens, bool(a.standin), a.max_num_seqs + 1)
            load.start()
            t_full = None
            lim = time.time() + 30
            while time.time() < lim:
                m = short_metrics(metrics(url))
                if m.get("running", 0) >= a.max_num_seqs and m.get("waiting", 0) >= 1:
                    t_full = time.time()
                    break
                time.sleep(0.5)
            ca["full_after_s"] = None if t_full is None else round(t_full - load.streams[0].t_start, 1)
            check("a: max_num_seqs running and one waiting", t_full is not None, short_metrics(metrics(url)))
            t_end = time.time() + a.busy
            while time.time() < t_end and time.time() < deadline - 120:
                m = short_metrics(metrics(url))
                h = tick_health()
                r = wd.run("a", state_ab, key_right)
                r["health"], r["metrics_before"] = h, m
                ca["runs"].append(r)
                time.sleep(max(0.0, a.interval - r["seconds"]))
            ca["seconds"] = round(time.time() - (t_full or time.time()), 1)
            ca["control_calls"] = wd.control_calls()[n0:]
            verdicts = [r["verdict"] for r in ca["runs"]]
            ca["verdicts"] = verdicts
            busy_seen = [r["metrics_before"] for r in ca["runs"]]
            full_runs = sum(
                1 for m in busy_seen if m.get("running", 0) >= a.max_num_seqs and m.get("waiting", 0) >= 1
            )
            ca["runs_at_full_load"] = full_runs
            check("a: >= 10 watchdog runs under load", len(ca["runs"]) >= 10, len(ca["runs"]))
            check(
                "a: the load stayed at max_num_seqs running + waiting in most runs",
                full_runs >= 0.8 * max(1, len(ca["runs"])),
                {"full": full_runs, "runs": len(ca["runs"])},
            )
            check(
                "a: no verdict 'fail' or 'config', only ok/busy",
                all(v in ("ok", "busy") for v in verdicts),
                verdicts,
            )
            check(
                "a: progress seen ('ok') in all but the first run",
                verdicts[1:] and all(v == "ok" for v in verdicts[1:]),
                verdicts,
            )
            check(
                "a: no journal line (no failure counted)",
                not any(r["journal"] for r in ca["runs"]),
                [ln for r in ca["runs"] for ln in r["journal"]],
            )
            check("a: no restart or stop", not ca["control_calls"], ca["control_calls"])
            check(
                "a: /health 200 throughout",
                all(r["health"] == 200 for r in ca["runs"]),
                sorted({str(r["health"]) for r in ca["runs"]}),
            )
            done = [s for s in load.streams if s.finished]
            ca["streams_finished_during_a"] = len(done)
            ca["stream_errors"] = [s.error[:200] for s in load.streams if s.error]
        except Exception as exc:
            check("a: ran", False, f"{type(exc).__name__}: {exc}")

        # ---- case b: the engine stopped while busy
        try:
            cb: dict = {"runs": []}
            summary["cases"]["b_engine_stopped_busy"] = cb
            n0 = len(wd.control_calls())
            if load is not None:
                load.replenish = False
            cb["metrics_at_stop"] = short_metrics(metrics(url))
            t_stop = time.time()
            stop_engine()
            cb["t_stop_s"] = round(t_stop - T0, 2)
            cb["engine_state_after_stop"] = proc_state(engine_pid) if engine_pid else None
            log(f"engine stopped (pid {engine_pid}, state {cb['engine_state_after_stop']})")
            t_restart = None
            lim = t_stop + a.stall + (a.failures + 3) * a.interval + 30
            while time.time() < min(lim, deadline - 45):
                m = short_metrics(metrics(url))
                h = tick_health()
                r = wd.run("b", state_ab, key_right)
                r["health"], r["metrics_before"] = h, m
                cb["runs"].append(r)
                if any(x.startswith("restart") for x in r["systemctl"]):
                    t_restart = time.time()
                    break
                time.sleep(max(0.0, a.interval - r["seconds"]))
            cb["control_calls"] = wd.control_calls()[n0:]
            cb["restart_after_stop_s"] = None if t_restart is None else round(t_restart - t_stop, 1)
            bound = a.stall + (a.failures + 1) * a.interval + 10
            cb["bound_s"] = [a.stall, bound]
            check(
                "b: /health still 200 while the engine is stopped",
                bool(cb["runs"]) and all(r["health"] == 200 for r in cb["runs"]),
                [r["health"] for r in cb["runs"]],
            )
            check("b: the watchdog restarted the unit", t_restart is not None, cb["control_calls"])
            check(
                "b: restart decided within stall..stall+(failures+1)*interval+10 s "
                f"({a.stall:.0f}..{bound:.0f} s)",
                t_restart is not None and a.stall <= t_restart - t_stop <= bound,
                cb["restart_after_stop_s"],
            )
            fails = [r for r in cb["runs"] if r["verdict"] == "fail"]
            check(
                f"b: exactly {a.failures} failed looks ('stalled') before the restart, one restart call",
                len(fails) == a.failures
                and all("stalled" in (r["reason"] or "") for r in fails)
                and [x["args"].split()[0] for x in cb["control_calls"]] == ["restart"],
                {"fails": [r["reason"] for r in fails], "calls": cb["control_calls"]},
            )
            cb["journal"] = [ln for r in cb["runs"] for ln in r["journal"]]
        except Exception as exc:
            check("b: ran", False, f"{type(exc).__name__}: {exc}")
        finally:
            cont_engine()

        # ---- case b2: the engine stopped while idle (optional, budget permitting)
        try:
            if load is not None:
                load.abort_all()
            lim = time.time() + 30
            idle = False
            while time.time() < lim:
                m = short_metrics(metrics(url))
                if m and m.get("running", 1) == 0 and m.get("waiting", 1) == 0:
                    idle = True
                    break
                time.sleep(0.5)
            need = a.failures * (a.interval + a.timeout + 3) + 30
            summary["cases"]["b2_engine_stopped_idle"] = cb2 = {"runs": [], "idle_after_abort": idle}
            if not idle or time.time() + need > deadline - 30:
                cb2["skipped"] = "not idle after aborting the streams" if not idle else "budget"
                log(f"b2 skipped: {cb2['skipped']}")
            else:
                n0 = len(wd.control_calls())
                r = wd.run("b2-before", state_ab, key_right)
                cb2["runs"].append(r)
                check("b2: idle, running engine -> probe ok", r["verdict"] == "ok", r["reason"])
                time.sleep(a.interval)
                t_stop = time.time()
                stop_engine()
                t_restart = None
                while time.time() < t_stop + need and time.time() < deadline - 25:
                    h = tick_health()
                    r = wd.run("b2", state_ab, key_right)
                    r["health"] = h
                    cb2["runs"].append(r)
                    if any(x.startswith("restart") for x in r["systemctl"]):
                        t_restart = time.time()
                        break
                    time.sleep(max(0.0, a.interval - r["seconds"]))
                cont_engine()
                cb2["control_calls"] = wd.control_calls()[n0:]
                cb2["restart_after_stop_s"] = None if t_restart is None else round(t_restart - t_stop, 1)
                cb2["journal"] = [ln for r in cb2["runs"] for ln in r["journal"]]
                check(
                    "b2: /health still 200 while the idle engine is stopped",
                    all(r.get("health") == 200 for r in cb2["runs"][1:]),
                    [r.get("health") for r in cb2["runs"][1:]],
                )
                fails = [r for r in cb2["runs"] if r["verdict"] == "fail"]
                check(
                    f"b2: {a.failures} failed one-token probes, then one restart",
                    t_restart is not None
                    and len(fails) == a.failures
                    and all("probe failed" in (r["reason"] or "") for r in fails),
                    {
                        "after_s": cb2["restart_after_stop_s"],
                        "fails": [r["reason"] for r in fails],
                        "calls": cb2["control_calls"],
                    },
                )
        except Exception as exc:
            check("b2: ran", False, f"{type(exc).__name__}: {exc}")
        finally:
            cont_engine()
        return 0
    finally:
        if load is not None:
            load.abort_all()
            summary["streams"] = load.report()
        summary["systemctl_calls"] = wd.calls_list()
        summary["systemctl_control_calls"] = wd.control_calls()
        try:
            if engine_pid:
                os.kill(engine_pid, signal.SIGCONT)
        except OSError:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(OSError):
                os.killpg(srv.pid, sig)
            try:
                srv.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
        vlog.close()
        summary["server_exit"] = srv.poll()
        write_summary()
        log(f"summary: passed={summary['passed']} ({sum(c['ok'] for c in checks)}/{len(checks)} checks)")


if __name__ == "__main__":
    rc = main()
    try:
        s = json.loads((Path(sys.argv[sys.argv.index("--out") + 1]) / "summary.json").read_text())
        rc = rc or (0 if s.get("passed") else 1)
    except (OSError, ValueError, IndexError):
        pass
    sys.exit(rc)
