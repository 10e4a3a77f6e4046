#!/usr/bin/env python3
"""Health watchdog of the served method's unit (standard library only; run by a systemd timer).

One run = one probe. GET <url>/health (and, with --completion-model, a one-token completion) must
answer 200 within --timeout seconds. Failures are counted across runs in --state (JSON):

  * the unit is not active (stopped by the operator, the memory guard or a failed start): nothing is
    probed and the count is reset - the watchdog never starts a server someone stopped;
  * a server still loading is not judged: failures count only once /health has answered for this
    invocation of the unit (its InvocationID), or once it has been active longer than --grace seconds;
  * --failures consecutive failures restart the unit (``systemctl restart``), unless --max-restarts
    restarts already happened within --window seconds: then the watchdog gives up - it stops the
    unit and its own timer, says so in one journal line, and exits 1 (the watchdog's service is left
    failed; `systemctl --failed` shows it) so a crash loop ends in a clear state, not a restart storm.

Exit codes: 0 healthy or nothing to do, 1 gave up (see the journal line), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

TAG = "sparkllm-watchdog"


def log(msg: str) -> None:
    print(f"{TAG}: {msg}", flush=True)  # stdout of a systemd service goes to the journal


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unit", required=True, help="the method's unit, e.g. sparkllm-vllm-mtp.service")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--state", required=True, type=Path, help="state file (JSON) kept between runs")
    p.add_argument("--failures", type=int, default=3, help="failures in a row before a restart (default: 3)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts allowed per window (default: 3)")
    p.add_argument("--window", type=float, default=3600.0, help="rate-limit window, seconds (default: 3600)")
    p.add_argument("--timeout", type=float, default=10.0, help="probe timeout, seconds (default: 10)")
    p.add_argument("--grace", type=float, default=1200.0,
                   help="seconds a never-healthy unit may load before failures count (default: 1200)")
    p.add_argument("--completion-model", default=None,
                   help="also ask this served model for one token (default: /health only)")
    p.add_argument("--api-key-file", type=Path, default=None, help="file holding the API key (default: none)")
    p.add_argument("--timer", default=None, help="the watchdog's timer, stopped on give-up (default: none)")
    p.add_argument("--systemctl", default="systemctl", help="systemctl binary (default: systemctl)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.failures < 1 or a.max_restarts < 0 or a.window <= 0 or a.timeout <= 0:
        build_parser().error("--failures must be >= 1, --max-restarts >= 0, --window and --timeout > 0")
    return a


def unit_state(systemctl: str, unit: str) -> dict[str, str]:
    out = subprocess.run(
        [systemctl, "show", unit, "-p", "ActiveState", "-p", "InvocationID",
         "-p", "ActiveEnterTimestampMonotonic"],
        capture_output=True, text=True, check=False,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _get(url: str, timeout: float, headers: dict[str, str], body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - local URL from our unit
        r.read(65536)
        return r.status


def probe(a: argparse.Namespace) -> str:
    """'' when healthy, else one short reason."""
    headers: dict[str, str] = {}
    if a.api_key_file:
        headers["Authorization"] = "Bearer " + a.api_key_file.read_text(encoding="utf-8").strip()
    try:
        status = _get(a.url.rstrip("/") + "/health", a.timeout, {})
        if status != 200:
            return f"/health answered {status}"
        if a.completion_model:
            body = json.dumps({"model": a.completion_model, "prompt": "ping", "max_tokens": 1}).encode()
            status = _get(a.url.rstrip("/") + "/v1/completions", a.timeout,
                          {**headers, "Content-Type": "application/json"}, body)
            if status != 200:
                return f"one-token completion answered {status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # timeouts, refused connections, reset sockets
        return f"no answer ({type(exc).__name__}: {exc})"
    return ""


def load_state(path: Path) -> dict:
    try:
        st = json.loads(path.read_text(encoding="utf-8"))
        return st if isinstance(st, dict) else {}
    except (OSError, ValueError):
        return {}


def save_state(path: Path, st: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(st, f)
    os.replace(tmp, path)


def run(a: argparse.Namespace, now: float | None = None) -> int:
    now = time.time() if now is None else now
    st = load_state(a.state)
    st.setdefault("restarts", [])
    st["restarts"] = [t for t in st["restarts"] if now - t < a.window]
    us = unit_state(a.systemctl, a.unit)
    if us.get("ActiveState") != "active":
        st.update(failures=0, invocation=None, healthy_seen=False)
        save_state(a.state, st)
        return 0
    if st.get("gave_up"):
        # started again after a give-up (the timer is stopped then): the operator's start is the
        # acknowledgement, so the rate limit starts afresh
        log(f"{a.unit}: active again after the give-up; restart count reset")
        st.update(gave_up=None, restarts=[])
    if us.get("InvocationID") != st.get("invocation"):
        st.update(invocation=us.get("InvocationID"), failures=0, healthy_seen=False)
    reason = probe(a)
    if not reason:
        st.update(failures=0, healthy_seen=True)
        save_state(a.state, st)
        return 0
    active_for = time.monotonic() - int(us.get("ActiveEnterTimestampMonotonic") or 0) / 1e6
    if not st.get("healthy_seen") and active_for < a.grace:
        log(f"{a.unit}: {reason}; still loading ({active_for:.0f}s of {a.grace:.0f}s grace), not counted")
        save_state(a.state, st)
        return 0
    st["failures"] = int(st.get("failures", 0)) + 1
    log(f"{a.unit}: probe failed ({st['failures']}/{a.failures}): {reason}")
    if st["failures"] < a.failures:
        save_state(a.state, st)
        return 0
    if len(st["restarts"]) >= a.max_restarts:
        n = len(st["restarts"])
        log(f"{a.unit}: GAVE UP: unhealthy again after {n} restarts within {a.window:.0f}s; "
            f"stopping it{' and ' + a.timer if a.timer else ''} (last probe: {reason}); read its "
            f"journal, fix it, then: systemctl reset-failed {TAG}.service; systemctl start {a.unit}"
            f"{' ' + a.timer if a.timer else ''}")
        subprocess.run([a.systemctl, "stop", "--no-block", a.unit], check=False)
        if a.timer:
            subprocess.run([a.systemctl, "stop", "--no-block", a.timer], check=False)
        st.update(failures=0, gave_up=now)
        save_state(a.state, st)
        return 1
    st["restarts"].append(now)
    st.update(failures=0, healthy_seen=False)
    save_state(a.state, st)
    log(f"{a.unit}: restarting after {a.failures} failed probes "
        f"(restart {len(st['restarts'])} of {a.max_restarts} allowed within {a.window:.0f}s)")
    subprocess.run([a.systemctl, "restart", "--no-block", a.unit], check=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
