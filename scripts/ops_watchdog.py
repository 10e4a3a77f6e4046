#!/usr/bin/env python3
"""Liveness watchdog of the served method's unit (standard library only; run by a systemd timer).

It judges progress, not latency. vLLM answers ``/health`` with 200 while its engine hangs (0.19.1
``entrypoints/serve/instrumentator/health.py`` asks ``engine_client.check_health()``, which raises only
once the engine is dead), and a request sent while ``max_num_seqs`` requests run waits in the queue, so
neither ``/health`` nor a timed request tells a busy server from a hung one. One run = one look:

  * ``GET /metrics`` (no API key needed): ``vllm:generation_tokens_total`` and
    ``vllm:prompt_tokens_total`` advance each engine step and ``vllm:request_success_total`` when a
    request ends; ``vllm:num_requests_running`` / ``_waiting`` say whether anything is in flight
    (0.19.1 and 0.26.0 ``vllm/v1/metrics/loggers.py``). A chunked prefill moves none of those three
    (no output, so no IterationStats: 0.19.1 ``v1/engine/async_llm.py:666``; prompt tokens are counted
    at the first output token), but every engine step returns its SchedulerStats even without outputs
    (0.19.1 ``v1/core/sched/scheduler.py:1544-1554``, 0.26.0 the same) and the logger sets
    ``vllm:kv_cache_usage_perc`` from them each step (0.19.1 ``v1/metrics/loggers.py:1046``): a prompt's
    chunks take new full-attention KV blocks, so the gauge changes at least once every ceil(block_size /
    chunk) steps, and every step under ``mamba_cache_mode`` align, whose chunks end on block boundaries
    (0.19.1 ``v1/core/sched/scheduler.py:298-345``; mode none takes a hybrid's linear-attention block
    once, at the first schedule, when ``vllm:prefix_cache_queries_total`` advances too). A counter that
    advanced, or that gauge at another value, since the last run: alive. Requests in flight and none
    of them moved for --stall seconds: stalled, a failure (a hung engine makes no step, so no series
    moves: it fails as fast as before).
  * nothing in flight: a one-token completion (--completion-model) must answer within --timeout; when
    it does not, /metrics is read again and only a server that made no progress meanwhile counts a
    failure (a burst that arrived at the probe's moment is busy, not hung);
  * 401/403 (the key) and 404 (the model name, or a server without /metrics) are configuration errors:
    reported once with the fix, never counted, never a restart; a missing key file is one such line;
  * the unit is not active (stopped by the operator, the memory guard or a failed start): nothing is
    probed and the count is reset - the watchdog never starts a server someone stopped;
  * --pause-file exists (the serve stage writes it for a deploy or a method switch and removes it
    after): nothing is judged, unless it is older than --pause-max seconds (a deploy that died without
    cleaning up), which is said once and then ignored;
  * a server still loading is not judged: failures count only once it answered for this invocation of
    the unit (its InvocationID), or once it has been active longer than --grace seconds;
  * --failures consecutive failures restart the unit (``systemctl restart``), unless --max-restarts
    restarts already happened within --window seconds: then the watchdog gives up - it stops the
    unit and its own timer, says so in one journal line, and exits 1 (the watchdog's service is left
    failed; `systemctl --failed` shows it) so a crash loop ends in a clear state, not a restart storm.

On a worker Spark of a Ray cluster (--ray-node) there is no API to probe: the head's vLLM drives the
worker's Ray actors (0.19.1 ``vllm/v1/executor/ray_executor.py``: ``RayWorkerWrapper`` actors placed on
every node's GPU), so the engine's progress is judged by the head's watchdog, and a dead or hung worker
rank shows there as a stalled or dead server. What only the worker can fix is its own Ray node, so a run
there judges that instead:

  * ``GET /api/local_raylet_healthz`` of the node's Ray dashboard agent (Ray 2.60
    ``dashboard/modules/reporter/healthz_agent.py``, public even with token authentication): 200
    "success" while the head's GCS holds this node alive; 503 once the GCS declared it dead, and no
    answer when the node's Ray processes are gone: both are failures, restarting the node's Ray unit
    (``ray start`` rejoins the head);
  * --ray-head (the head's GCS address over the link): a head that does not answer is reported once,
    never counted: restarting the worker cannot fix the head or the cable, and the agent itself treats
    an unreachable GCS as no verdict.

The decision itself is pure (:func:`judge`, :func:`judge_probe`) over successive /metrics samples and
the probe's result; the last verdict is kept in the state file (``last``). A /metrics value the decision
reads that is NaN, infinite or negative is no answer (a failure), never "busy".

The watchdog repairs its own state: a field of the wrong type is reset and the rest kept, a corrupt file
is kept beside itself as ``NAME.corrupt``, one journal line each; a state file that cannot be written is
kept in FALLBACK_DIR meanwhile (said once), and where nothing can be written a failure restarts the unit
at once (the line says why), since failures could not be counted across runs.

Exit codes: 0 healthy or nothing to do, 1 gave up (see the journal line), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

# the shared CLI plumbing: beside this script on the Spark (role spark_ops copies sparkllm/cli.py along)
from sparkllm import cli

TAG = "sparkllm-watchdog"

# Metric names of vLLM 0.19.1 and 0.26.0 (vllm/v1/metrics/loggers.py; prometheus_client appends _total
# to a counter's samples). tests/contract/test_watchdog_contract.py checks them against both sources.
GENERATED = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
FINISHED = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge, set from every step's SchedulerStats (prefill included)
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"  # counter, advances as requests are scheduled
WAITING = "vllm:num_requests_waiting"
STARTED = "process_start_time_seconds"
CONFIG_STATUSES = (401, 403, 404)
# where the state goes while its own file cannot be written (a read-only or full state directory): a tmpfs
# of root's, kept between the timer's runs until a reboot; the state file's own place is tried first each run
FALLBACK_DIR = Path("/run/sparkllm-watchdog")


def log(msg: str) -> None:
    print(f"{TAG}: {msg}", flush=True)  # stdout of a systemd service goes to the journal


# ----------------------------------------------------------------------------------------- decision
@dataclass(frozen=True)
class Sample:
    """What one GET /metrics said, summed over engines and labels."""

    t: float
    generated: float
    prompt: float
    finished: float
    running: float
    waiting: float
    started: float | None = None
    kv_usage: float | None = None  # None: the server exposes no such series (older stand-ins)
    prefix_queries: float | None = None

    @property
    def in_flight(self) -> float:
        return self.running + self.waiting


@dataclass(frozen=True)
class Probe:
    """The one-token completion: status None = no answer (``error`` says why)."""

    status: int | None
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """kind: ok (alive), busy (in flight, not yet judged), probe (idle: ask for one token),
    fail (counts towards a restart), config (reported once, never a restart)."""

    kind: str
    reason: str
    progress_at: float | None = None


def _both(prev: float | None, cur: float | None) -> bool:
    return prev is not None and cur is not None


def _same_server(prev: Sample | None, cur: Sample) -> bool:
    return (prev is not None and prev.started == cur.started and cur.generated >= prev.generated
            and cur.prompt >= prev.prompt and cur.finished >= prev.finished
            and not (_both(prev.prefix_queries, cur.prefix_queries)
                     and cur.prefix_queries < prev.prefix_queries))  # type: ignore[operator]


def _advanced(prev: Sample, cur: Sample) -> str:
    """What moved between two samples of one server ('' when nothing did): a counter that advanced,
    or the KV-cache gauge at another value (a prefill step takes blocks; a hung engine sets nothing)."""
    parts = [f"+{cur.generated - prev.generated:.0f} tokens" if cur.generated > prev.generated else "",
             f"+{cur.prompt - prev.prompt:.0f} prompt tokens" if cur.prompt > prev.prompt else "",
             f"+{cur.finished - prev.finished:.0f} finished" if cur.finished > prev.finished else ""]
    if _both(prev.kv_usage, cur.kv_usage) and cur.kv_usage != prev.kv_usage:
        parts.append(f"KV cache {100 * prev.kv_usage:.4g}% -> {100 * cur.kv_usage:.4g}%")  # type: ignore[operator]
    if _both(prev.prefix_queries, cur.prefix_queries) and cur.prefix_queries > prev.prefix_queries:  # type: ignore[operator]
        parts.append(f"+{cur.prefix_queries - prev.prefix_queries:.0f} prefix-cache queries")  # type: ignore[operator]
    return ", ".join(p for p in parts if p)


def judge(prev: Sample | None, cur: Sample, progress_at: float | None, stall: float) -> Verdict:
    """Judge one sample against the previous one. ``progress_at``: when the counters last advanced
    (or requests were first seen in flight); ``stall``: seconds in flight without progress that fail."""
    flight = f"{cur.running:.0f} running, {cur.waiting:.0f} waiting"
    if _same_server(prev, cur):
        assert prev is not None
        moved = _advanced(prev, cur)
        if moved:
            return Verdict("ok", f"progress: {moved} in {cur.t - prev.t:.0f} s ({flight})", cur.t)
    else:
        prev = None  # first look, or the server restarted: a new baseline
    if cur.in_flight <= 0:
        return Verdict("probe", "nothing in flight")
    if prev is None or prev.in_flight <= 0 or progress_at is None:
        return Verdict("busy", f"{flight}; watching for progress", cur.t)
    silent = cur.t - progress_at
    if silent < stall:
        return Verdict("busy", f"{flight}; no new token for {silent:.0f} s of {stall:.0f} s", progress_at)
    return Verdict("fail", f"stalled: {flight}, no token generated for {silent:.0f} s, nor any prefill "
                           f"progress (KV cache unchanged) (/health may still say 200: vLLM's does while its "
                           f"engine hangs)", progress_at)


def judge_probe(cur: Sample, probe: Probe, after: Sample | None, model: str, key_file: str | None) -> Verdict:
    """Judge the one-token completion sent while nothing was in flight; ``after``: /metrics read
    again after a probe that did not answer (None when that read failed too)."""
    if probe.status == 200:
        return Verdict("ok", f"idle; one-token probe answered in {probe.seconds:.1f} s")
    if probe.status in (401, 403):
        where = f"the key in {key_file}" if key_file else "no key"
        return Verdict("config", f"the server refused the one-token probe (HTTP {probe.status}) with "
                                 f"{where}: the key was rotated or the server runs with another one; put "
                                 "the server's key in vllm_api_key_file and rerun the serve and ops stages "
                                 "(no restart: the server itself is fine)")
    if probe.status == 404:
        return Verdict("config", f"the server does not serve model {model!r} (HTTP 404): set "
                                 "vllm_served_model_name to the name in GET /v1/models and rerun the ops "
                                 "stage (no restart: the server itself is fine)")
    if after is not None and _same_server(cur, after) and _advanced(cur, after):
        return Verdict("busy", f"probe unanswered ({probe.error or probe.status}) but the server made "
                               f"progress meanwhile: {_advanced(cur, after)}", after.t)
    what = f"HTTP {probe.status}" if probe.status else f"no answer ({probe.error})"
    return Verdict("fail", f"idle, and the one-token probe failed: {what}")


# ------------------------------------------------------------------------------------ observation
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


class NoAnswer(ValueError):
    """/metrics answered, but a value the watchdog judges by is no count (NaN, infinite, negative)."""


_JUDGED = (GENERATED, PROMPT, FINISHED, RUNNING, WAITING, STARTED, KV_USAGE, PREFIX_QUERIES)


def parse_metrics(text: str, t: float) -> Sample:
    """Prometheus text -> Sample; ValueError naming the metric vLLM did not expose, NoAnswer naming a
    judged metric whose value is not a finite number >= 0 (such a value is no answer: NaN compares
    false with everything, so it would read as "in flight, no progress yet" for ever)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            if m.group(1) in _JUDGED and not (math.isfinite(value) and value >= 0):
                raise NoAnswer(f"/metrics: {m.group(1)} is {m.group(3)} (not a finite count >= 0): taken as "
                               "no answer from the engine")
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + value
    missing = [n for n in (GENERATED, RUNNING) if n not in sums]
    if missing:
        raise ValueError(f"/metrics has no {' or '.join(missing)}: is this vLLM with its stats on "
                         "(no --disable-log-stats)? The watchdog judges progress by them")
    return Sample(t, sums[GENERATED], sums.get(PROMPT, 0.0), sums.get(FINISHED, 0.0), sums[RUNNING],
                  sums.get(WAITING, 0.0), sums.get(STARTED), sums.get(KV_USAGE), sums.get(PREFIX_QUERIES))


def _request(url: str, timeout: float, headers: dict[str, str],
             body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - local URL from our unit
            return r.status, r.read(4 << 20)
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _no_answer(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def sample(url: str, timeout: float) -> tuple[Sample | None, str, int | None]:
    """(sample, failure reason, HTTP status of a refusal)."""
    try:
        status, body = _request(url.rstrip("/") + "/metrics", timeout, {})
    except (OSError, ValueError) as exc:  # timeouts, refused connections, reset sockets
        return None, f"no answer ({_no_answer(exc)}) from /metrics", None
    if status != 200:
        return None, f"/metrics answered HTTP {status}", status
    try:
        return parse_metrics(body.decode("utf-8", "replace"), time.time()), "", None
    except NoAnswer as exc:
        return None, str(exc), None
    except ValueError as exc:
        return None, str(exc), 404


def read_key(path: Path | None) -> tuple[str | None, str]:
    """(key, configuration error)."""
    if path is None:
        return None, ""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        return None, (f"cannot read the API key file {path} ({exc.strerror or type(exc).__name__}): write "
                      "the server's key there or set vllm_api_key_file, then rerun the ops stage")
    if not key:
        return None, f"the API key file {path} is empty: write the server's key into it"
    return key, ""


def probe_completion(a: argparse.Namespace, key: str | None) -> Probe:
    headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})}
    body = json.dumps({"model": a.completion_model, "prompt": "ping", "max_tokens": 1}).encode()
    t0 = time.monotonic()
    try:
        status, _ = _request(a.url.rstrip("/") + "/v1/completions", a.timeout, headers, body)
    except (OSError, ValueError) as exc:
        return Probe(None, _no_answer(exc), time.monotonic() - t0)
    return Probe(status, "", time.monotonic() - t0)


def health(a: argparse.Namespace) -> str:
    """'' when GET /health answered 200, else why not."""
    try:
        status, _ = _request(a.url.rstrip("/") + "/health", a.timeout, {})
    except (OSError, ValueError) as exc:
        return f"no answer ({_no_answer(exc)}) from /health"
    return "" if status == 200 else f"/health answered HTTP {status}"


def observe(a: argparse.Namespace, prev: Sample | None,
            progress_at: float | None) -> tuple[Verdict, Sample | None]:
    """One look at the server: the verdict and the sample to keep for the next run."""
    why = health(a)
    if why:
        return Verdict("fail", why), None
    cur, why, status = sample(a.url, a.timeout)
    if cur is None:
        if status in CONFIG_STATUSES:
            return Verdict("config", f"{why}: spark_ops_url ({a.url}) must point at the vLLM server itself "
                                     "(its /metrics needs no key); fix it and rerun the ops stage"), None
        return Verdict("fail", why), None
    v = judge(prev, cur, progress_at, a.stall)
    if v.kind != "probe":
        return v, cur
    if not a.completion_model:
        return Verdict("ok", "idle; /health answered (no one-token probe configured)"), cur
    key, err = read_key(a.api_key_file)
    if err:
        return Verdict("config", err), cur
    p = probe_completion(a, key)
    # read again after the probe: its own token is no one's progress, and a probe that did not answer
    # is judged by whether the server moved meanwhile
    after, _, _ = sample(a.url, a.timeout)
    v = judge_probe(cur, p, after, a.completion_model, str(a.api_key_file) if a.api_key_file else None)
    return v, (after or cur)


def _connects(address: str, timeout: float) -> str:
    """'' when a TCP connection to HOST:PORT opens, else why not."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return ""
    except (OSError, ValueError) as exc:
        return _no_answer(exc)


def judge_ray_node(status: int | None, body: str, error: str = "") -> Verdict:
    """The node agent's answer to /api/local_raylet_healthz (status None: no answer)."""
    if status == 200 and body.strip() == "success":
        return Verdict("ok", "Ray node alive in the cluster (the node agent's raylet health check)")
    if status == 503:
        return Verdict("fail", f"the head's GCS holds this Ray node dead: {body.strip()[:200] or 'HTTP 503'}")
    if status is None:
        return Verdict("fail", f"the node's Ray agent does not answer ({error}): its Ray processes are gone")
    return Verdict("fail", f"the node's Ray agent answered HTTP {status}: {body.strip()[:200]}")


def observe_ray(a: argparse.Namespace, st: dict) -> Verdict:
    """One look at this node's Ray: the agent's raylet health; the head's reachability is only reported."""
    if a.ray_head:
        why = _connects(a.ray_head, a.timeout)
        if why and st.get("ray_head") != "down":
            log(f"{a.unit}: the head's GCS at {a.ray_head} does not answer over the link ({why}); "
                "not a fault of this node, nothing restarted: check the head's Ray unit and the cable")
            st["ray_head"] = "down"
        elif not why and st.pop("ray_head", None):
            log(f"{a.unit}: the head's GCS at {a.ray_head} answers again")
    try:
        status, body = _request(a.ray_node.rstrip("/") + "/api/local_raylet_healthz", a.timeout, {})
    except (OSError, ValueError) as exc:
        return judge_ray_node(None, "", _no_answer(exc))
    return judge_ray_node(status, body.decode("utf-8", "replace"))


# ------------------------------------------------------------------------------------- the run
def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser("ops_watchdog.py", __doc__)
    p.add_argument("--unit", required=True, help="the method's unit, e.g. sparkllm-vllm-mtp.service")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    what.add_argument("--ray-node", default=None,
                      help="a worker's Ray: its dashboard agent's base URL, e.g. http://127.0.0.1:52365")
    p.add_argument("--ray-head", default=None,
                   help="with --ray-node: the head's GCS address HOST:PORT, reported when it does not answer")
    p.add_argument("--state", required=True, type=Path, help="state file (JSON) kept between runs")
    p.add_argument("--failures", type=int, default=3, help="failures in a row before a restart (default: 3)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts allowed per window (default: 3)")
    p.add_argument("--window", type=float, default=3600.0, help="rate-limit window, seconds (default: 3600)")
    p.add_argument("--timeout", type=float, default=10.0, help="per request, seconds (default: 10)")
    p.add_argument("--stall", type=float, default=300.0,
                   help="seconds in flight without a new token, nor a KV-cache change (prefill), that "
                        "fail (default: 300)")
    p.add_argument("--grace", type=float, default=9900.0,
                   help="seconds a never-answering unit may load before failures count (default: 9900)")
    p.add_argument("--completion-model", default=None,
                   help="when idle, ask this served model for one token (default: /health only)")
    p.add_argument("--api-key-file", type=Path, default=None, help="file holding the API key (default: none)")
    p.add_argument("--pause-file", type=Path, default=None,
                   help="while this file exists (a deploy or switch runs) nothing is judged (default: none)")
    p.add_argument("--pause-max", type=float, default=19800.0,
                   help="a pause file older than this many seconds is stale and ignored (default: 19800)")
    p.add_argument("--timer", default=None, help="the watchdog's timer, stopped on give-up (default: none)")
    p.add_argument("--systemctl", default="systemctl", help="systemctl binary (default: systemctl)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.ray_head and not a.ray_node:
        build_parser().error("--ray-head goes with --ray-node")
    if (a.failures < 1 or a.max_restarts < 0 or a.window <= 0 or a.timeout <= 0 or a.stall <= 0
            or a.pause_max <= 0):
        build_parser().error("--failures must be >= 1, --max-restarts >= 0, --window, --timeout, --stall and "
                             "--pause-max > 0")
    return a


def unit_state(systemctl: str, unit: str) -> dict[str, str]:
    out = subprocess.run(
        [systemctl, "show", unit, "-p", "ActiveState", "-p", "InvocationID",
         "-p", "ActiveEnterTimestampMonotonic"],
        capture_output=True, text=True, check=False,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# each field of the state and what a valid value is; an invalid one is dropped (its default applies)
_FIELDS = {
    "failures": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "invocation": lambda v: v is None or isinstance(v, str),
    "healthy_seen": lambda v: isinstance(v, bool),
    "progress_at": lambda v: v is None or _finite(v),
    "gave_up": lambda v: v is None or _finite(v),
    "sample": lambda v: v is None or _sample_of(v) is not None,
    "last": lambda v: isinstance(v, dict),
    "config_error": lambda v: isinstance(v, str),
    "paused": lambda v: isinstance(v, str),
    "ray_head": lambda v: isinstance(v, str),
    "state_fallback": lambda v: isinstance(v, str),
}


def repair_state(st: dict) -> list[str]:
    """Drop every field whose value is of the wrong type or range (a restart time at a time); return
    what was reset, each as ``field (the bad value)``. Valid fields are kept as they are."""
    reset = []
    restarts = st.get("restarts", [])
    if not isinstance(restarts, list):
        reset.append(f"restarts ({json.dumps(restarts)[:40]})")
        st.pop("restarts")
    elif any(not _finite(t) for t in restarts):
        st["restarts"] = [t for t in restarts if _finite(t)]
        reset.append(f"restarts ({len(restarts) - len(st['restarts'])} of {len(restarts)} entries)")
    for field, valid in _FIELDS.items():
        if field in st and not valid(st[field]):
            reset.append(f"{field} ({json.dumps(st.pop(field))[:40]})")
    return reset


def _fallback(path: Path) -> Path:
    return FALLBACK_DIR / (str(path.absolute()).strip("/").replace("/", "_") or "watchdog.json")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return -1.0


def load_state(path: Path) -> dict:
    """The state kept between runs (from the fallback when that is newer: the file could not be
    written). Never raises: an unreadable file is said and started afresh, a corrupt one is kept beside
    itself as ``NAME.corrupt`` and said, invalid fields are reset and said, one line each."""
    src = _fallback(path) if _mtime(_fallback(path)) >= max(_mtime(path), 0.0) else path
    try:
        raw = src.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log(f"cannot read the state file {src} ({exc.strerror or exc}); starting afresh (failures and the "
            f"restart history are not counted): make it readable by root")
        return {}
    try:
        st = json.loads(raw.decode("utf-8"))
        if not isinstance(st, dict):
            raise ValueError(f"a JSON {type(st).__name__}, not an object")
    except ValueError as exc:
        keep = src.with_name(src.name + ".corrupt")
        try:
            keep.write_bytes(raw)
            kept = f"kept it as {keep}"
        except OSError as err:
            kept = f"could not keep a copy at {keep} ({err.strerror or err})"
        log(f"the state file {src} is corrupt ({str(exc)[:80]}); {kept} and started afresh: its failures "
            "and restart history are not counted")
        return {}
    reset = repair_state(st)
    if reset:
        log(f"the state file {src} held invalid values, reset: {', '.join(reset)}; the other fields kept")
    return st


def save_state(path: Path, st: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(st, f)
        # readable by the GB10 exporter (a DynamicUser): restarts and give-ups become alerts; no secret in it
        os.fchmod(f.fileno(), 0o644)
    os.replace(tmp, path)


def keep_state(path: Path, st: dict) -> str:
    """Write the state to its file, or while that cannot be written to the fallback (said once);
    '' when it was kept somewhere, else why not (then nothing can be counted across runs)."""
    fallback = _fallback(path)
    try:
        save_state(path, {k: v for k, v in st.items() if k != "state_fallback"})
    except OSError as exc:
        why = f"{path}: {exc.strerror or exc}"
    else:
        if fallback.exists():
            fallback.unlink(missing_ok=True)
            log(f"the state file {path} can be written again; {fallback} removed")
        return ""
    try:
        save_state(fallback, {**st, "state_fallback": str(path)})
    except OSError as exc:
        return f"{why}; {fallback}: {exc.strerror or exc}"
    if st.get("state_fallback") != str(path):
        log(f"cannot write the state file {why}; keeping the state in {fallback} until it can be written "
            f"(lost on a reboot): make {path.parent} writable by root")
    st["state_fallback"] = str(path)
    return ""


def _keep(a: argparse.Namespace, st: dict) -> str:
    """keep_state, and one line when the state could be kept nowhere."""
    why = keep_state(a.state, st)
    if why:
        log(f"{a.unit}: the watchdog's state cannot be written ({why}): failures cannot be counted across "
            f"runs; make {a.state.parent} writable by root")
    return why


def paused(a: argparse.Namespace, st: dict, now: float) -> bool:
    """True while a fresh pause file exists; a stale one is reported once and ignored."""
    if a.pause_file is None:
        return False
    try:
        age = now - a.pause_file.stat().st_mtime
        by = a.pause_file.read_text(encoding="utf-8", errors="replace").strip()[:200]
    except OSError:
        if st.pop("paused", None):
            log(f"{a.unit}: pause ended; watching again")
        return False
    if age <= a.pause_max:
        if st.get("paused") != by:
            log(f"{a.unit}: paused while {by or 'a deploy'} runs ({a.pause_file}); nothing is judged")
            st["paused"] = by
        return True
    if st.get("paused") != "stale":
        log(f"{a.unit}: ignoring the stale pause file {a.pause_file} ({age:.0f} s old, more than "
            f"{a.pause_max:.0f} s: a deploy that ended without removing it); remove it: rm {a.pause_file}")
        st["paused"] = "stale"
    return False


_OPTIONAL = ("started", "kv_usage", "prefix_queries")


def _sample_of(d: object) -> Sample | None:
    # a state written before kv_usage / prefix_queries existed lacks them: they default to None
    if not isinstance(d, dict) or not set(Sample.__dataclass_fields__) - set(_OPTIONAL[1:]) <= set(d) \
            or not set(d) <= set(Sample.__dataclass_fields__):
        return None
    if d["started"] is not None and not _finite(d["started"]):
        return None
    if any(d.get(k) is not None and not (_finite(d[k]) and d[k] >= 0) for k in _OPTIONAL[1:]):
        return None
    if not all(_finite(v) and (k == "t" or v >= 0) for k, v in d.items() if k not in _OPTIONAL):
        return None
    return Sample(**d)


def run(a: argparse.Namespace, now: float | None = None) -> int:
    now = time.time() if now is None else now
    st = load_state(a.state)
    st.setdefault("restarts", [])
    st["restarts"] = [t for t in st["restarts"] if now - t < a.window]
    if paused(a, st, now):
        st.update(failures=0, sample=None, progress_at=None)
        _keep(a, st)
        return 0
    us = unit_state(a.systemctl, a.unit)
    if us.get("ActiveState") != "active":
        st.update(failures=0, invocation=None, healthy_seen=False, sample=None, progress_at=None)
        _keep(a, st)
        return 0
    if st.get("gave_up"):
        # started again after a give-up (the timer is stopped then): the operator's start is the
        # acknowledgement, so the rate limit starts afresh
        log(f"{a.unit}: active again after the give-up; restart count reset")
        st.update(gave_up=None, restarts=[])
    if us.get("InvocationID") != st.get("invocation"):
        st.update(invocation=us.get("InvocationID"), failures=0, healthy_seen=False, sample=None,
                  progress_at=None)
    if a.ray_node:
        v, cur = observe_ray(a, st), None
        seen = v.kind == "ok"
    else:
        v, cur = observe(a, _sample_of(st.get("sample")), st.get("progress_at"))
        seen = cur is not None
    st.update(sample=asdict(cur) if cur else None, progress_at=v.progress_at,
              last={"t": now, "kind": v.kind, "reason": v.reason})
    if seen:
        st["healthy_seen"] = True  # /health and /metrics answered (a Ray node: its agent said alive): loaded
    if v.kind == "config":
        if st.get("config_error") != v.reason:
            log(f"{a.unit}: CONFIGURATION ERROR, not a dead server (no restart): {v.reason}")
            st["config_error"] = v.reason
        _keep(a, st)
        return 0
    if v.kind == "ok" and st.get("config_error") and (v.reason.startswith("idle")
                                                      or st["config_error"].startswith("/metrics")):
        log(f"{a.unit}: the configuration error is gone ({v.reason})")
        st.pop("config_error")
    if v.kind in ("ok", "busy"):
        if v.kind == "ok":
            st["failures"] = 0
        _keep(a, st)
        return 0
    return _failed(a, st, us, v.reason, now)


def _failed(a: argparse.Namespace, st: dict, us: dict[str, str], reason: str, now: float) -> int:
    active_for = time.monotonic() - int(us.get("ActiveEnterTimestampMonotonic") or 0) / 1e6
    if not st.get("healthy_seen") and active_for < a.grace:
        log(f"{a.unit}: {reason}; still loading ({active_for:.0f}s of {a.grace:.0f}s grace), not counted")
        _keep(a, st)
        return 0
    st["failures"] = int(st.get("failures", 0)) + 1
    log(f"{a.unit}: probe failed ({st['failures']}/{a.failures}): {reason}")
    unkept = ""
    if st["failures"] < a.failures:
        unkept = keep_state(a.state, st)
        if not unkept:
            return 0
        # nowhere to count this failure: waiting for more would wait for ever, so this one restarts
        st["failures"] = a.failures
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
        _keep(a, st)
        return 1
    st["restarts"].append(now)
    st.update(failures=0, healthy_seen=False, sample=None, progress_at=None)
    unkept = unkept or keep_state(a.state, st)
    if unkept:
        log(f"{a.unit}: restarting now, as the watchdog's state cannot be written ({unkept}): failures "
            f"cannot be counted nor restarts limited; make {a.state.parent} writable by root: {reason}")
    else:
        log(f"{a.unit}: restarting after {a.failures} failed probes (restart {len(st['restarts'])} of "
            f"{a.max_restarts} allowed within {a.window:.0f}s): {reason}")
    subprocess.run([a.systemctl, "restart", "--no-block", a.unit], check=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    return cli.run_main("ops_watchdog.py", lambda: run(a))


if __name__ == "__main__":
    sys.exit(main())
