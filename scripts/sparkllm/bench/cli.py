"""Benchmark runner, results store and report for speculative decoding on an OpenAI/vLLM server.

Subcommands
-----------
``run``           (on the Spark; STANDARD LIBRARY ONLY) stream chat completions, scrape /metrics,
                  write ``DIR/<run-id>.json`` and append to ``DIR/results.sqlite``; one run per
                  concurrency level (closed loop) or per request rate (``--request-rate``: open-loop
                  Poisson arrivals, seeded; goodput against ``--goodput`` targets), and per depth.
``import``        (controller) merge run JSON files into a store directory, idempotently.
``lookup``        (controller) print the valid run stored for a configuration hash + repetition.
``report``        (controller; matplotlib imported lazily) Markdown report + PNG charts.
``fetch-prompts`` download Spec-Bench ``question.jsonl`` (pinned commit + sha256) and convert it.
``ceiling``       (stdlib) bytes read per generated token of a checkpoint directory and the decode
                  ceiling they allow (``sparkllm.bench.ceiling``); ``run --model-dir`` stores it per run.

Exit codes: 0 success; 1 the work failed (``run``: nothing answers at ``--base-url``, the run is
invalid, or the engine stalled for ``--stall-give-up`` seconds and the run was given up: it is still written
and stored, marked invalid (partial), and one line on stderr says why, also with ``--quiet``; ``lookup``: no
such run); 2 usage error (bad option values, a malformed ``--base-url``,
missing files named on the command line, an output the tool may not or cannot write: checked before
anything is measured); 130 after Ctrl-C (SIGINT), 143 after SIGTERM (sparkllm/cli.py): a measured phase
so stopped is still written and stored, marked invalid ("interrupted by SIGINT after N of M requests"),
and one line says so.

Known ``--meta-json`` keys (all optional, passed by the bench role): ``method``, ``config_hash``,
``repetition``, ``serve_argv``, ``speculative_config``, ``num_speculative_tokens``, ``topology``,
``toolkit_commit``, ``model_revision``, ``drafter_revision``; anything else is kept verbatim.

The ``run``, ``import``, ``lookup`` and ``fetch-prompts`` code is standard library only; the report
module (``sparkllm.bench.report``, matplotlib) is imported only by ``report``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sqlite3
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from sparkllm.bench import ceiling as bench_ceiling
from sparkllm.bench.client import Endpoint, Sampling
from sparkllm.bench.common import (
    DEFAULT_PROMPTS,
    REPORT_DIRNAME,
    SPECBENCH_MANIFEST,
    UsageError,
    WorkFailed,
    fmt,
)
from sparkllm.bench.depth import (
    DEFAULT_TOLERANCE,
    check_depths,
    check_text_covers,
    load_filler,
    served_max_len,
)
from sparkllm.bench.prompts import fetch_prompts, load_prompts
from sparkllm.bench.rate import parse_goodput, rate_list
from sparkllm.bench.records import PROFILE_DEFAULTS, PROFILES, ProfileDefaults
from sparkllm.bench.runner import RunOptions, execute_run
from sparkllm.bench.stall import DEFAULT_GIVE_UP_S, DEFAULT_STALL_S
from sparkllm.bench.store import (
    REQUEST_COLUMNS,
    RUN_COLUMNS,
    STORE_NAME,
    atomic_write_json,
    check_store,
    check_writable,
    find_run,
    import_runs,
    open_store,
    store_run,
)
from sparkllm.cli import (
    EXIT_SIGNAL,
    EXIT_USAGE,
    Interrupted,
    doc_parser,
    run_main,
    say_error,
    signal_exit,
    sigterm_unwinds,
    subcommands,
)


def print_summary(doc: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    s, sp = doc["summary"], doc["spec"]
    d = s["decode_tok_s"]
    rows = [
        ("run", doc["run_id"]), ("valid", "yes" if doc["valid"] else "NO: " + "; ".join(doc["problems"])),
        ("requests ok/total", f"{s['ok']}/{s['requests']}"),
        ("decode tok/s median [p5-p95]", f"{fmt(d['median'])} [{fmt(d['p5'])}-{fmt(d['p95'])}]"),
        ("decode tok/s mean (95% CI)", f"{fmt(d['mean'])} ({fmt(d['ci95_low'])}-{fmt(d['ci95_high'])})"),
        ("decode tok/s token-weighted", fmt(s["token_weighted"]["decode_tok_s"])),
        ("TTFT median s", fmt(s["ttft_s"]["median"], 3)), ("TPOT median ms", fmt(s["tpot_ms"]["median"])),
        ("tokens/chunk median", fmt(s["tokens_per_chunk"]["median"])),
        ("concurrency / input depth",
         f"{doc['meta'].get('concurrency') or '-'} / {doc['meta'].get('input_depth') or '-'}"),
        *_rate_rows(doc),
        ("aggregate output tok/s", fmt(s["token_weighted"]["output_tok_s_wall"])),
        ("J per output token", fmt((doc.get("telemetry") or {}).get("j_per_output_token"), 3)),
        ("acceptance rate", fmt(sp["acceptance_rate"], 3)),
        ("mean acceptance length", fmt(sp["mean_acceptance_length"], 3)),
        ("per-position acceptance", "/".join(fmt(x, 3) for x in sp["per_position"] or []) or "-"),
        ("effective tokens/step", fmt(sp["effective_tokens_per_step"], 3)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)


def _rate_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    rate, gp = doc["meta"].get("rate") or {}, doc["summary"].get("goodput")
    rows = []
    if rate:
        rows.append(("request rate offered / completed req/s",
                     f"{fmt(rate.get('request_rate'))} / {fmt(rate.get('completed_rate_req_s'))} "
                     f"({rate.get('arrivals')} arrivals, seed {rate.get('arrival_seed')})"))
    if gp:
        targets = ",".join(f"{k}={v:g}ms" for k, v in gp["targets_ms"].items())
        rows.append((f"goodput ({targets})", f"{gp['met']}/{gp['requests']} requests, "
                                              f"{fmt(gp['rate_req_s'])} req/s"))
    return rows


def _read_meta(arg: str | None) -> dict[str, Any]:
    if not arg:
        return {}
    text = arg
    if not arg.lstrip().startswith("{"):
        p = Path(arg)
        if not p.is_file():
            raise UsageError(f"--meta-json: {arg} is neither a JSON object nor a file")
        text = p.read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--meta-json: invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise UsageError("--meta-json must be a JSON object")
    return obj


def check_base_url(url: str) -> str:
    """The URL without a trailing slash; UsageError unless it is http(s)://HOST[:PORT][/PATH]."""
    fix = "pass --base-url like http://127.0.0.1:8000"
    u = urllib.parse.urlsplit(url.strip())
    if u.scheme not in ("http", "https"):
        raise UsageError(f"--base-url {url!r}: scheme must be http or https; {fix}")
    if not u.hostname:
        raise UsageError(f"--base-url {url!r}: no host; {fix}")
    try:
        port = u.port
    except ValueError:
        raise UsageError(f"--base-url {url!r}: the port is not a number in 1..65535; {fix}") from None
    if port == 0:
        raise UsageError(f"--base-url {url!r}: port 0 is not a server port; {fix}")
    if u.query or u.fragment or u.username or u.password:
        raise UsageError(f"--base-url {url!r}: no query, fragment or credentials (use --api-key-file); {fix}")
    url = url.strip().rstrip("/")
    # the server's root, not its OpenAI prefix: vLLM serves /metrics beside /v1, at the root
    # (vllm/entrypoints/serve/instrumentator/metrics.py:41), and the bench adds /v1/... itself
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


def check_reachable(ep: Endpoint, timeout: float = 10.0) -> None:
    """WorkFailed unless a server answers GET /v1/models at the base URL."""
    try:
        status, _ = ep.get("/v1/models", timeout=timeout)
    except (OSError, http.client.HTTPException) as exc:
        raise WorkFailed(f"nothing answers at {ep.base_url} ({exc}); start the server (make deploy, "
                         "ansible-playbook site.yml --tags serve) or fix --base-url") from None
    if status in (401, 403):
        raise WorkFailed(f"{ep.base_url} refused the request (HTTP {status}): pass --api-key-file with "
                         "the server's API key")
    if status >= 400:
        raise WorkFailed(f"{ep.base_url}/v1/models answered HTTP {status}: is this an OpenAI-compatible "
                         "server (vLLM)? fix --base-url")


def read_api_key(path: str | None) -> str | None:
    if not path:
        return None
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"--api-key-file {path}: cannot read it ({exc.strerror}); pass a readable file "
                         "holding the API key") from None
    if not key:
        raise UsageError(f"--api-key-file {path}: the file is empty; put the API key in it")
    return key


def int_list(text: str, flag: str, lo: int) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]; UsageError naming the flag for anything else (duplicates, < lo)."""
    items = str(text).split(",")
    if len(items) > 1 and not all(x.strip() for x in items):
        raise UsageError(f"{flag} {text!r}: an empty item (two commas, or one at an end); list integers, "
                         f"e.g. {flag} 1,2,4")
    try:
        vals = [int(x) for x in items if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers, e.g. {flag} 1,2,4") from None
    if not vals or min(vals) < lo or len(set(vals)) != len(vals):
        raise UsageError(f"{flag} {text!r}: need distinct integers >= {lo}, e.g. {flag} 1,2,4")
    return vals


def _rate_args(a: argparse.Namespace) -> tuple[list[float | None], int | None, float | None]:
    """(rates or [None], --num-requests, --duration); UsageError for a combination that means nothing."""
    if a.request_rate is None:
        for flag, v in (("--num-requests", a.num_requests), ("--duration", a.duration)):
            if v is not None:
                raise UsageError(f"{flag} applies to a request-rate run only; add --request-rate, e.g. "
                                 "--request-rate 0.5,1,2")
        return [None], None, None
    rates: list[float | None] = list(rate_list(a.request_rate))
    if a.concurrency is not None:
        raise UsageError("--request-rate with --concurrency: a rate run is open-loop (each request is sent "
                         "when it is due, whatever is in flight), so it has no concurrency level; run "
                         "the concurrency list and the rate list as two commands")
    if a.num_requests is not None and a.duration is not None:
        raise UsageError("--num-requests and --duration both bound a rate run; give one of them")
    if a.num_requests is not None and a.num_requests < 1:
        raise UsageError(f"--num-requests {a.num_requests}: need at least 1 request")
    if a.duration is not None and not a.duration > 0:
        raise UsageError(f"--duration {a.duration}: need a positive number of seconds, e.g. --duration 60")
    return rates, a.num_requests, a.duration


def _profile_args(a: argparse.Namespace) -> tuple[ProfileDefaults, str, str, int]:
    """(the profile's defaults, prompts file, thinking, warm-up requests) with the command line's choices on
    top; UsageError for a combination the profile cannot measure."""
    prof = PROFILE_DEFAULTS[a.profile]
    if a.profile != "decode":
        for flag, bad in (("--request-rate", a.request_rate is not None),
                          ("--depth", a.depth not in ("0", "")), ("--warmup", a.warmup is not None)):
            if bad:
                why = ("discards its whole first pass instead of warm-up requests" if flag == "--warmup"
                       else "has its own prompts and single-stream protocol")
                raise UsageError(f"{flag} does not apply to --profile {a.profile}: that profile {why}; drop "
                                 f"{flag} or use --profile decode")
    if a.profile == "agent" and a.concurrency not in (None, "1"):
        raise UsageError("--profile agent runs one conversation at a time; drop --concurrency")
    prompts = a.prompts or str(prof.prompts or DEFAULT_PROMPTS)
    thinking = a.thinking or prof.thinking
    warmup = 2 if a.warmup is None else a.warmup
    return prof, prompts, thinking, warmup


def cmd_run(a: argparse.Namespace) -> int:
    prof, a.prompts, a.thinking, a.warmup = _profile_args(a)
    rates, num_requests, duration = _rate_args(a)
    levels = int_list(a.concurrency or "1", "--concurrency", 1)
    depths = int_list(a.depth, "--depth", 0)
    targets = parse_goodput(a.goodput)
    if a.repeats < 1 or a.warmup < 0 or a.max_tokens < 2:
        raise UsageError("need --repeats >= 1, --warmup >= 0, --max-tokens >= 2")
    if a.agent_context_words < 0:
        raise UsageError("--agent-context-words must be >= 0 (0: no background), e.g. 3000")
    if not 0 < a.depth_tolerance < 0.5:
        raise UsageError("--depth-tolerance must be a fraction between 0 and 0.5, e.g. 0.05")
    if not 0 < a.stall_timeout <= a.stall_give_up < float("inf"):
        raise UsageError(f"--stall-timeout {a.stall_timeout:g} / --stall-give-up {a.stall_give_up:g}: need "
                         f"0 < stall timeout <= give-up, e.g. --stall-timeout {DEFAULT_STALL_S:g} "
                         f"--stall-give-up {DEFAULT_GIVE_UP_S:g}")
    if not 0 <= a.temperature < float("inf"):  # vLLM refuses a negative one (vllm/sampling_params.py:452)
        raise UsageError(f"--temperature {a.temperature:g}: must be 0 (greedy) or more, e.g. --temperature 0")
    base_url = check_base_url(a.base_url)
    if base_url != a.base_url.strip().rstrip("/"):
        print(f"bench.py run: note: --base-url {a.base_url} ends in /v1; using {base_url} (the bench adds "
              "/v1/... and /metrics itself)", file=sys.stderr)
    api_key = read_api_key(a.api_key_file)
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory; pass a results directory")
    _check_out(out, "--out")  # an output the run cannot write is refused before anything is measured
    load_prompts(Path(a.prompts), a.category)  # bad or missing prompts: a usage error, before any request
    depth_text = None
    if a.depth_text:
        if not any(depths):
            raise UsageError("--depth-text is the filler of a --depth run; add --depth, e.g. --depth 8192")
        depth_text = load_filler(Path(a.depth_text))
        check_text_covers(depth_text, depths)
    meta = _read_meta(a.meta_json)
    ceiling = bench_ceiling.for_run(a, meta)  # None without --model-dir
    ep = Endpoint(base_url, api_key)
    check_reachable(ep)
    check_depths([d for d in depths if d], a.max_tokens, served_max_len(ep.get_json("/v1/models"), a.model))
    failed = 0
    for depth in depths:
        for level in levels:
            for rate in rates:
                opts = RunOptions(base_url=base_url, model=a.model, label=a.label, out=out,
                                  prompts=Path(a.prompts), category=a.category, repeats=a.repeats,
                                  warmup=a.warmup, concurrency=level, api_key=api_key, meta=meta,
                                  sampling=Sampling(a.max_tokens, a.temperature, a.seed, a.thinking,
                                                    prof.stream),
                                  profile=a.profile, warmup_pass=prof.warmup_pass,
                                  agent_context_words=a.agent_context_words,
                                  progress=not a.quiet, depth=depth, depth_tolerance=a.depth_tolerance,
                                  depth_text=depth_text,
                                  request_rate=rate, num_requests=num_requests, duration_s=duration,
                                  arrival_seed=a.arrival_seed, goodput=targets,
                                  stall_timeout=a.stall_timeout, stall_give_up=a.stall_give_up)
                rc = _one_run(opts, ceiling)
                if rc > EXIT_USAGE:  # a signal: its partial run is kept; the runs after it are not made
                    return rc
                failed += rc
    return 1 if failed else 0


def _check_out(out: Path, flag: str) -> None:
    """UsageError (naming the path and the fix) unless a file can be written in ``out`` (or where it would be
    made) and its results store, when there is one, is a store that can be written; nothing is changed."""
    from sparkllm.outdir import OutputRefused, probe_writable

    try:
        probe_writable(out, flag)
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    check_store(out / STORE_NAME)
    check_writable(out / STORE_NAME)


def _one_run(opts: RunOptions, ceiling: dict[str, Any] | None = None) -> int:
    doc = execute_run(opts)
    bench_ceiling.attach(doc, ceiling)
    path = opts.out / f"{doc['run_id']}.json"
    atomic_write_json(path, doc)
    try:
        conn = open_store(opts.out)
        try:
            store_run(conn, doc)
        finally:
            conn.close()
    except sqlite3.Error as exc:  # the run is safe in its JSON file: name the store and the way back
        raise WorkFailed(f"{opts.out / STORE_NAME}: {exc}; the run is kept in {path}: repair or move the "
                         f"store, then `bench.py import {path} --store {opts.out}`") from None
    print_summary(doc)
    print(f"wrote {path}")
    stop = (doc["meta"].get("interrupted") or {}).get("signal")
    if stop:
        print(f"bench.py run: {doc['problems'][0]}: those are written to {path} and stored, marked partial "
              "and invalid", file=sys.stderr)
        return EXIT_SIGNAL[signal.Signals[stop]]
    if (doc.get("stall") or {}).get("gave_up"):  # one line; the runs after it are not made
        raise WorkFailed(f"{doc['problems'][0]}; written to {path} and stored, marked partial and invalid")
    for w in doc.get("warnings") or []:
        print(f"bench.py run: warning: run {doc['run_id']}: {w}", file=sys.stderr)
    if not doc["valid"]:
        print(f"bench.py run: error: run {doc['run_id']} is invalid: {'; '.join(doc['problems'])} "
              "(written and stored, marked invalid)", file=sys.stderr)
        return 1
    return 0


def cmd_lookup(a: argparse.Namespace) -> int:
    run_id = find_run(Path(a.store), a.config_hash, a.repetition)
    if run_id is None:
        return 1
    print(run_id)
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    paths = [Path(p) for p in a.paths]
    store = Path(a.store) if a.store else (paths[0] if paths[0].is_dir() else paths[0].parent)
    added, skipped = import_runs(paths, store)
    print(f"imported {added} run(s), {skipped} already present, store {store / STORE_NAME}")
    return 0


def cmd_fetch_prompts(a: argparse.Namespace) -> int:
    if a.source != "specbench":
        raise UsageError(f"unknown prompt source {a.source!r}: only 'specbench'")
    if Path(a.dest).is_dir():
        raise UsageError(f"--dest {a.dest}: is a directory; name the JSONL file to write")
    try:
        manifest = json.loads(Path(a.manifest).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--manifest {a.manifest}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise UsageError(f"--manifest {a.manifest}: invalid JSON ({exc})") from None
    n = fetch_prompts(manifest, Path(a.dest), a.url, a.sha256, a.allow_unpinned)
    print(f"wrote {n} prompts to {a.dest}")
    return 0


# runs.csv columns after the store's: the outputs verdict (reference, same, differs, not checked, invalid),
# K and the per-position acceptance ("0.800/0.400"), so a sort by speed shows what is wrong beside it
EXPORT_RUN_EXTRA = ("verdict", "k", "per_position_acceptance")


def run_verdicts(store: Path, baseline: str) -> dict[str, str]:
    """run id -> the outputs verdict of its report row (bench_analysis.verdict_word), as the report
    decides it now."""
    from sparkllm.bench import analysis as bench_analysis  # controller only (matplotlib is not imported)
    from sparkllm.bench import report as bench_report

    stats = bench_report.method_table(bench_report.load_runs(store), baseline)
    bench_analysis.output_checks(stats, baseline, bench_report.pair_runs)
    return {r.run_id: bench_analysis.verdict_word(m, baseline) for m in stats for r in m.runs}


def _export_extra(doc: dict[str, Any], verdict: str | None) -> tuple[Any, ...]:
    spec = doc.get("spec") or {}
    pos = spec.get("per_position") or []
    return (verdict or ("invalid" if not doc.get("valid") else "not checked"),
            spec.get("num_speculative_tokens"), "/".join(f"{x:.3f}" for x in pos))


def cmd_export(a: argparse.Namespace) -> int:
    """runs.csv (one line per run) and requests.csv (one per request, with its output) from a store."""
    import csv
    import io

    from sparkllm.fileio import write_bytes_atomic
    from sparkllm.outdir import OutputRefused, check_output_dir, probe_writable, write_marker

    store = Path(a.dir)
    if not (store / STORE_NAME).is_file():
        raise UsageError(f"{store}: holds no {STORE_NAME}; pass the results store directory")
    check_store(store / STORE_NAME)  # before the export directory is made
    out = Path(a.out) if a.out else store / "export"
    try:
        check_output_dir(out, "bench.py export", flag="--out")
        probe_writable(out, "--out")
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "bench.py export")
    conn = open_store(store)
    try:
        verdicts = run_verdicts(store, a.baseline)
        tables = (("runs", [c for c in RUN_COLUMNS if c != "doc"]), ("requests", list(REQUEST_COLUMNS)))
        for table, cols in tables:
            buf = io.StringIO()
            w = csv.writer(buf)
            extra = list(EXPORT_RUN_EXTRA) if table == "runs" else []
            w.writerow(cols + extra)
            sql = f"SELECT {','.join(cols + (['doc'] if extra else []))} FROM {table} ORDER BY run_id"
            for r in conn.execute(sql):
                row = tuple(r)
                if extra:
                    doc = json.loads(row[-1])
                    row = (*row[:-1], *_export_extra(doc, verdicts.get(doc["run_id"])))
                w.writerow(row)
            write_bytes_atomic(out / f"{table}.csv", buf.getvalue().encode("utf-8"))
    finally:
        conn.close()
    print(f"wrote {out / 'runs.csv'} and {out / 'requests.csv'}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    store = Path(a.dir)
    if not store.is_dir():
        raise UsageError(f"{store}: not a directory; pass the results store directory "
                         f"(it holds {STORE_NAME})")
    from sparkllm.bench.analysis import summary_lines
    from sparkllm.bench.report import make_report  # controller only: the run side never imports it

    path, stats = make_report(store, Path(a.out) if a.out else None, a.baseline, not a.no_charts)
    for line in summary_lines(stats, a.baseline):
        print(line)
    print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    exit_codes = __doc__[__doc__.index("Exit codes:"):].split("\n\n")[0]
    p = doc_parser("bench.py", f"{__doc__.splitlines()[0]}\n\n{exit_codes}")
    add = subcommands(p)

    def parser(name: str, text: str) -> argparse.ArgumentParser:
        return add(name, text, description=text)

    r = parser("run", "benchmark a running server (stdlib only)")
    r.add_argument("--base-url", required=True,
                   help="server URL, http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000 (a trailing /v1 is "
                        "dropped, with a note: the bench adds /v1/... and /metrics itself)")
    r.add_argument("--model", required=True, help="served model name")
    r.add_argument("--label", required=True, help="method/config label, e.g. mtp-k2")
    r.add_argument("--out", required=True, help="results directory (run JSON + results.sqlite)")
    r.add_argument("--profile", choices=PROFILES, default="decode",
                   help="what to measure: decode (streamed decode tok/s, thinking off), records (the public "
                        "records' protocol: whole non-streamed requests, the chat template's thinking "
                        "default, a token limit per prompt, first pass discarded, e2e tok/s), agent "
                        "(multi-turn conversations sharing a growing prefix: TTFT of later turns) "
                        "(default: decode)")
    r.add_argument("--prompts", default=None,
                   help="JSONL prompt set; a line may carry its own max_tokens (and, for agent, followups) "
                        "(default: the profile's set: prompts.jsonl, records.jsonl or agent.jsonl)")
    r.add_argument("--category", default=None, help="only these categories, comma separated (default: all)")
    r.add_argument("--repeats", type=int, default=1, help="passes over the prompt set")
    r.add_argument("--warmup", type=int, default=None,
                   help="decode profile: warm-up requests, not measured (default 2; records and agent "
                        "discard a whole first pass instead)")
    r.add_argument("--max-tokens", type=int, default=256,
                   help="tokens generated per request, for a prompt without its own max_tokens")
    r.add_argument("--concurrency", default=None,
                   help="requests in flight at once; a list (1,2,4) measures one run per level (default 1)")
    r.add_argument("--request-rate", default=None,
                   help="open-loop load instead: Poisson arrivals at this many requests/s, seeded; a list "
                        "(0.5,1,2) measures one run per rate; not with --concurrency "
                        "(default: none, closed loop)")
    r.add_argument("--num-requests", type=int, default=None,
                   help="rate runs: arrivals per run (default: the prompt set times --repeats)")
    r.add_argument("--duration", type=float, default=None,
                   help="rate runs: send every arrival of the first S seconds instead of --num-requests "
                        "(default: none)")
    r.add_argument("--arrival-seed", type=int, default=0, help="rate runs: seed of the arrival schedule")
    r.add_argument("--goodput", default=None,
                   help="targets a request must meet to count as goodput, e.g. ttft=2000ms,tpot=100ms "
                        "(ttft, tpot, e2e; ms or s; default: no goodput)")
    r.add_argument("--depth", default="0",
                   help="input tokens per request, calibrated against the server's usage count; a list "
                        "(0,8192,32768) measures one run per depth (0: the prompt set as it is)")
    r.add_argument("--depth-tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="how far the served prompt length may be from the depth (fraction)")
    r.add_argument("--depth-text", default=None, metavar="FILE",
                   help="build depths from this UTF-8 text (your code or documents) instead of the generated "
                        "filler; recorded by sha256, never repeated (a depth it cannot fill is refused) "
                        "(default: the generated filler)")
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    r.add_argument("--seed", type=int, default=0, help="sampling seed")
    r.add_argument("--api-key-file", default=None,
                   help="file holding the server's API key (default: none, no Authorization header)")
    r.add_argument("--meta-json", default=None,
                   help="JSON object or file with serve args, spec config, ... (default: none)")
    r.add_argument("--thinking", choices=("on", "off", "default"), default=None,
                   help="the model's thinking mode; default = the chat template's own (not sent) "
                        "(default: off for decode and agent, the template's default for records)")
    r.add_argument("--agent-context-words", type=int, default=3000,
                   help="agent profile: words of background in each conversation's first turn (~4k tokens)")
    r.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_S, metavar="S",
                   help="an engine that makes no progress (no token, no rise of "
                        "vllm:generation_tokens_total) for S seconds with a request in flight makes the run "
                        "invalid; a prefill may take 3x the longest first-token wait seen "
                        f"(default {DEFAULT_STALL_S:g}: ~400 tokens at the slowest public decode rate of "
                        "this model on a Spark, docs/benchmarks.md)")
    r.add_argument("--stall-give-up", type=float, default=DEFAULT_GIVE_UP_S, metavar="S",
                   help="a stall this long ends the run: what was measured is written and stored as partial "
                        f"and invalid, one line says so, exit 1 (default {DEFAULT_GIVE_UP_S:g})")
    r.add_argument("--quiet", action="store_true",
                   help="no progress line (the summary, the written path and, for a failed run, the one "
                        "line saying why are still printed)")
    bench_ceiling.add_run_options(r)
    r.set_defaults(func=cmd_run)
    i = parser("import", "merge run JSON files into a store directory (idempotent)")
    i.add_argument("paths", nargs="+", help="run JSON files or directories holding them")
    i.add_argument("--store", default=None, help="store directory (default: the first directory given)")
    i.set_defaults(func=cmd_import)
    lk = parser("lookup", "print the valid run stored for a configuration hash + repetition "
                "(exit 1 when there is none)")
    lk.add_argument("--store", required=True, help="store directory")
    lk.add_argument("--config-hash", required=True, help="configuration hash")
    lk.add_argument("--repetition", type=int, required=True, help="repetition index")
    lk.set_defaults(func=cmd_lookup)
    rep = parser("report", "Markdown report + PNG charts (charts need matplotlib) from a store")
    rep.add_argument("dir", help="results store directory")
    rep.add_argument("--out", default=None, help=f"report directory (default: DIR/{REPORT_DIRNAME})")
    rep.add_argument("--baseline", default="baseline", help="label of the baseline method")
    rep.add_argument("--no-charts", action="store_true", help="Markdown only")
    rep.set_defaults(func=cmd_report)
    ex = parser("export", "every run and request of a store as CSV (runs.csv, requests.csv)")
    ex.add_argument("dir", help="results store directory")
    ex.add_argument("--csv", action="store_true", required=True, help="write CSV (the only format)")
    ex.add_argument("--out", default=None, help="directory for the CSV files (default: DIR/export)")
    ex.add_argument("--baseline", default="baseline",
                    help="label of the baseline method (the verdict column compares with it)")
    ex.set_defaults(func=cmd_export)
    f = parser("fetch-prompts", "download + verify + convert an external prompt set")
    f.add_argument("--source", required=True, choices=("specbench",), help="prompt source")
    f.add_argument("--dest", required=True, help="converted JSONL file to write")
    f.add_argument("--manifest", default=str(SPECBENCH_MANIFEST), help="pinned source manifest")
    f.add_argument("--url", default=None,
                   help="override the download URL (mirror, file://; default: the manifest's pinned URL)")
    f.add_argument("--sha256", default=None, help="override the pinned sha256 (default: the manifest's)")
    f.add_argument("--allow-unpinned", action="store_true", help="accept a source without a pinned sha256")
    f.set_defaults(func=cmd_fetch_prompts)
    bench_ceiling.add_parser(parser)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        with sigterm_unwinds():  # SIGTERM unwinds like Ctrl-C: a measured phase keeps what it measured
            return run_main(f"bench.py {a.cmd}", lambda: dispatch(a), failed=(OSError, sqlite3.Error))
    except (KeyboardInterrupt, Interrupted) as exc:  # outside a measured phase: nothing half written
        name, rc = signal_exit(exc)
        return say_error(f"bench.py {a.cmd}", f"interrupted by {name} before a run was measured; runs "
                         "finished earlier are kept", rc)


def dispatch(a: argparse.Namespace) -> int:
    try:
        return int(a.func(a))
    except SystemExit as exc:
        if isinstance(exc.code, str):  # raised with a message deeper down: a failure of the work
            raise WorkFailed(exc.code) from None
        raise
