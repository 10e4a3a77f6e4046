#!/usr/bin/env python3
"""One step of the phase-aware readiness wait of a vLLM server unit (standard library only).

Reads the unit's journal (``journalctl -u UNIT -o json``, from --since the first time, after the
saved cursor afterwards), classifies every line into the start's phases (sparkllm/serve_phases.py:
the phases, their patterns from the vLLM sources and their default budgets) and polls the health URL,
for at most --step seconds, returning at the first phase change. The state of the wait goes in on
stdin (empty the first time) and comes back in the JSON on stdout, so the caller (the serve role's
spark_serve_wait action) calls it again until the status is no longer "waiting":

  waiting   still starting; "events" lists the phases entered in this step
  ready     the health URL answered 200
  stalled   the log was silent longer than the current phase's budget
  exited    the unit's server exited or was restarted by systemd (see the unit's journal)
  timeout   --timeout seconds since --since passed, though the log still advanced

Exit codes: 0 a status was reported, 1 the wait itself failed (journalctl missing), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sparkllm.cli import UsageError, WorkFailed, doc_parser, run_main
from sparkllm.serve_phases import Tracker, check_budgets, title


def build_parser() -> argparse.ArgumentParser:
    p = doc_parser("serve_wait.py", __doc__)
    p.add_argument("--unit", required=True, help="systemd unit of the server")
    p.add_argument("--since", required=True, type=float, help="epoch seconds the start began")
    p.add_argument("--health", required=True, help="URL that answers 200 once the server is ready")
    p.add_argument("--budgets", default="{}", help="JSON object phase -> seconds of silence allowed")
    p.add_argument("--timeout", type=float, default=7200, help="seconds from --since before giving up")
    p.add_argument("--step", type=float, default=20, help="seconds this call may run")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between journal and health polls")
    p.add_argument("--lines", type=int, default=20, help="last lines of the phase kept for a report")
    return p


def _journal(unit: str, since: float, cursor: str | None) -> tuple[list[tuple[float, str]], str | None]:
    argv = ["journalctl", "--unit", unit, "--output", "json", "--no-pager"]
    argv += ["--after-cursor", cursor] if cursor else ["--since", f"@{int(since)}"]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    out = []
    for raw in res.stdout.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        msg = rec.get("MESSAGE")
        if isinstance(msg, list):  # journald gives non-UTF-8 messages as a byte array
            msg = bytes(b for b in msg if isinstance(b, int)).decode("utf-8", "replace")
        cursor = rec.get("__CURSOR", cursor)
        if not isinstance(msg, str) or rec.get("_PID") == "1":
            continue  # systemd's own "Starting/Started" records are not the server's output
        ts = int(rec.get("__REALTIME_TIMESTAMP", time.time() * 1e6)) / 1e6
        for line in msg.replace("\r", "\n").splitlines():
            if line.strip():
                out.append((ts, line))
    return out, cursor


def _unit_state(unit: str) -> dict:
    res = subprocess.run(["systemctl", "show", unit, "-p", "ActiveState", "-p", "SubState", "-p",
                          "NRestarts", "-p", "ExecMainStatus"], capture_output=True, text=True, check=False)
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - the server's own URL
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _progress(ev: dict, t0: float) -> str:
    left = ev["left"]
    return (f"phase {title(left['phase'])} took {left['seconds']:.0f} s; now {title(ev['entered'])} "
            f"({ev['at'] - t0:.0f} s since the start)")


def step(args: argparse.Namespace, state: dict | None) -> dict:
    budgets = check_budgets(json.loads(args.budgets))
    if state:
        tr, cursor, restarts0 = Tracker.from_dict(state["tracker"]), state["cursor"], state["restarts"]
    else:
        tr, cursor = Tracker(args.since, budgets, args.lines), None
        restarts0 = _unit_state(args.unit).get("NRestarts", "0")
    end = time.time() + args.step
    events: list[dict] = []
    status = "waiting"
    while True:
        lines, cursor = _journal(args.unit, args.since, cursor)
        for ts, line in lines:
            ev = tr.feed(line, ts)
            if ev:
                events.append({"text": _progress(ev, tr.t0), **ev})
        now = time.time()
        unit = _unit_state(args.unit)
        if _healthy(args.health):
            ev = tr.finish(now)
            events.append({"text": _progress(ev, tr.t0).replace("; now ready", "; ready"), **ev})
            status = "ready"
        elif (tr.restarted or unit.get("NRestarts", "0") != restarts0
              or unit.get("SubState") in ("auto-restart", "failed", "dead", "exited")
              or unit.get("ActiveState") in ("failed", "inactive")):
            status = "exited"
        elif tr.stalled(now):
            status = "stalled"
        elif now - args.since > args.timeout:
            status = "timeout"
        if status != "waiting" or events or now >= end:
            break
        time.sleep(args.poll)
    now = time.time()
    return {"status": status, "phase": tr.phase, "phase_title": title(tr.phase),
            "phase_seconds": round(now - tr.phase_start, 1), "silent_seconds": round(tr.silent_for(now), 1),
            "budget": tr.budgets.get(tr.phase), "elapsed": round(now - args.since, 1),
            "phases": tr.history, "last_lines": list(tr.tail), "unit": unit, "events": events,
            "state": {"tracker": tr.to_dict(), "cursor": cursor, "restarts": restarts0}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main("serve_wait.py", lambda: wait_step(args))


def wait_step(args: argparse.Namespace) -> int:
    try:
        check_budgets(json.loads(args.budgets))
        raw = sys.stdin.read() if not sys.stdin.isatty() else ""
        state = json.loads(raw) if raw.strip() and raw.strip() != "null" else None
    except ValueError as exc:
        raise UsageError(f"{exc} (--budgets takes a JSON object phase -> seconds; stdin the saved "
                         "state)") from None
    try:
        result = step(args, state)
    except FileNotFoundError as exc:
        raise WorkFailed(f"{exc.filename} not found: the wait needs journalctl and systemctl") from None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
