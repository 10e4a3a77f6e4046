"""bench: the SQLite results store and the import of run JSON files (standard library only).

Results store (SQLite, ``DIR/results.sqlite``), schema version 3 (``PRAGMA user_version`` and
table ``schema``; see docs/results-store.md). Version 1 below; version 2 adds (``MIGRATIONS``)
runs.input_depth/output_tok_s_aggregate/j_per_output_token/warnings, requests.prompt_tokens/
prefill_tok_s/output_sha256/output_text and table output_checks; version 3 (request-rate mode)
runs.request_rate/completed_rate_req_s/goodput_targets/goodput_share/goodput_req_s and
requests.arrival_s/lag_s/meets_targets::

    schema(version INTEGER PRIMARY KEY, applied_utc TEXT, description TEXT)
    runs(run_id TEXT PRIMARY KEY, label TEXT, method TEXT, config_hash TEXT, repetition INTEGER,
         valid INTEGER, problems TEXT /* JSON list */, started_utc TEXT, finished_utc TEXT,
         concurrency INTEGER, requests INTEGER, errors INTEGER, output_tokens INTEGER,
         decode_tok_s_median REAL, decode_tok_s_p5 REAL, decode_tok_s_p95 REAL,
         decode_tok_s_mean REAL, ttft_s_median REAL, tpot_ms_median REAL,
         tokens_per_chunk_median REAL, acceptance_rate REAL, mean_acceptance_length REAL,
         effective_tokens_per_step REAL, doc TEXT /* the full run JSON */)
    requests(run_id TEXT REFERENCES runs(run_id), idx INTEGER, prompt_id TEXT, category TEXT,
             repeat INTEGER, ok INTEGER, error TEXT, output_tokens INTEGER, chunks INTEGER,
             ttft_s REAL, decode_s REAL, e2e_s REAL, decode_tok_s REAL, tpot_ms REAL,
             tokens_per_chunk REAL, PRIMARY KEY (run_id, idx))

Version 4 (profiles) adds runs.profile/e2e_tok_s_mean/e2e_tok_s_ci95_low/e2e_tok_s_ci95_high and
requests.e2e_tok_s/turn.

``migrate()`` applies the entries of ``MIGRATIONS`` above the store's version (docs/results-store.md).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparkllm.bench.common import UsageError, utc_now
from sparkllm.fileio import fsync_dir, fsync_file, write_bytes_atomic

STORE_NAME = "results.sqlite"
SCHEMA_VERSION = 4


def add_columns(table: str, *columns: str) -> str:
    """A migration's ALTER TABLE statements, one per "name TYPE" column added to ``table``."""
    return "".join(f"ALTER TABLE {table} ADD COLUMN {c};\n" for c in columns)


MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "initial schema: runs + requests", """
CREATE TABLE IF NOT EXISTS schema (version INTEGER PRIMARY KEY, applied_utc TEXT NOT NULL,
                                   description TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, label TEXT NOT NULL, method TEXT, config_hash TEXT, repetition INTEGER,
    valid INTEGER NOT NULL, problems TEXT NOT NULL, started_utc TEXT, finished_utc TEXT,
    concurrency INTEGER, requests INTEGER, errors INTEGER, output_tokens INTEGER,
    decode_tok_s_median REAL, decode_tok_s_p5 REAL, decode_tok_s_p95 REAL, decode_tok_s_mean REAL,
    ttft_s_median REAL, tpot_ms_median REAL, tokens_per_chunk_median REAL, acceptance_rate REAL,
    mean_acceptance_length REAL, effective_tokens_per_step REAL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS runs_cell ON runs (config_hash, repetition);
CREATE TABLE IF NOT EXISTS requests (
    run_id TEXT NOT NULL REFERENCES runs(run_id), idx INTEGER NOT NULL, prompt_id TEXT, category TEXT,
    repeat INTEGER, ok INTEGER, error TEXT, output_tokens INTEGER, chunks INTEGER, ttft_s REAL,
    decode_s REAL, e2e_s REAL, decode_tok_s REAL, tpot_ms REAL, tokens_per_chunk REAL,
    PRIMARY KEY (run_id, idx));
"""),
    (2, "load, depth, outputs and energy: request outputs, run depth/energy, output checks", "\n"
     + add_columns("runs", "input_depth INTEGER", "output_tok_s_aggregate REAL", "j_per_output_token REAL",
                   "warnings TEXT")
     + add_columns("requests", "prompt_tokens INTEGER", "prefill_tok_s REAL", "output_sha256 TEXT",
                   "output_text TEXT")
     + """CREATE TABLE IF NOT EXISTS output_checks (
    run_id TEXT PRIMARY KEY REFERENCES runs(run_id), baseline_run_id TEXT, compared INTEGER,
    identical_share REAL, median_prefix_share REAL, floor_identical_share REAL,
    floor_median_prefix_share REAL, differs INTEGER NOT NULL, checked_utc TEXT NOT NULL);
"""),
    (3, "request-rate mode: offered rate, goodput against targets, arrival schedule", "\n"
     + add_columns("runs", "request_rate REAL", "completed_rate_req_s REAL", "goodput_targets TEXT",
                   "goodput_share REAL", "goodput_req_s REAL")
     + add_columns("requests", "arrival_s REAL", "lag_s REAL", "meets_targets INTEGER")),
    (4, "profiles: records (whole requests, e2e tok/s over passes) and agent (turns of a conversation)", "\n"
     + add_columns("runs", "profile TEXT", "e2e_tok_s_mean REAL", "e2e_tok_s_ci95_low REAL",
                   "e2e_tok_s_ci95_high REAL")
     + add_columns("requests", "e2e_tok_s REAL", "turn INTEGER")),
]

RUN_COLUMNS = ("run_id", "label", "method", "config_hash", "repetition", "valid", "problems", "started_utc",
               "finished_utc", "concurrency", "requests", "errors", "output_tokens", "decode_tok_s_median",
               "decode_tok_s_p5", "decode_tok_s_p95", "decode_tok_s_mean", "ttft_s_median", "tpot_ms_median",
               "tokens_per_chunk_median", "acceptance_rate", "mean_acceptance_length",
               "effective_tokens_per_step", "doc", "input_depth", "output_tok_s_aggregate",
               "j_per_output_token", "warnings", "request_rate", "completed_rate_req_s", "goodput_targets",
               "goodput_share", "goodput_req_s", "profile", "e2e_tok_s_mean", "e2e_tok_s_ci95_low",
               "e2e_tok_s_ci95_high")
REQUEST_COLUMNS = ("run_id", "idx", "prompt_id", "category", "repeat", "ok", "error", "output_tokens",
                   "chunks",
                   "ttft_s", "decode_s", "e2e_s", "decode_tok_s", "tpot_ms", "tokens_per_chunk",
                   "prompt_tokens", "prefill_tok_s", "output_sha256", "output_text", "arrival_s", "lag_s",
                   "meets_targets", "e2e_tok_s", "turn")


def _statements(sql: str) -> list[str]:
    """A migration's script as single statements (executescript would commit the caller's transaction)."""
    out, buf = [], ""
    for line in sql.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the store to SCHEMA_VERSION; refuse a newer store than this code understands.
    Concurrent writers: each migration runs in its own write transaction (BEGIN IMMEDIATE waits for the
    other writer, up to the connection's busy timeout) and re-reads the version inside it, so a migration
    another writer applied meanwhile is not applied twice (a second ALTER TABLE ADD COLUMN fails)."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise SystemExit(f"results store schema v{current} is newer than this bench.py (v{SCHEMA_VERSION}): "
                         "update the toolkit")
    if current == SCHEMA_VERSION:
        return current
    level = conn.isolation_level
    conn.isolation_level = None  # explicit transactions below
    try:
        for version, desc, sql in MIGRATIONS:
            if version <= current:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                current = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > current:
                    for stmt in _statements(sql):
                        conn.execute(stmt)
                    conn.execute("INSERT OR REPLACE INTO schema VALUES (?, ?, ?)", (version, utc_now(), desc))
                    conn.execute(f"PRAGMA user_version = {int(version)}")
                    current = version
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
    finally:
        conn.isolation_level = level
    return current


SQLITE_MAGIC = b"SQLite format 3\x00"
STORE_TABLES = {"schema", "runs", "requests"}


def check_store(db: Path) -> None:
    """UsageError unless ``db`` is absent (a new store), empty (0 bytes: a store another writer is
    creating; its schema is made under the write lock) or a results store: a file that is not SQLite, a
    damaged one (``PRAGMA quick_check``) or another program's database is refused and left as it is."""
    if not db.exists():
        return
    fix = (f"move it away and rebuild the store from the run JSON files beside it "
           f"(`bench.py import {db.parent}`), or pass the directory of your results store")
    if not db.is_file():
        raise UsageError(f"{db} is not a file, so not a results store; {fix}")
    if db.stat().st_size == 0:
        return  # SQLite's empty database: an older toolkit's writer opened it a moment ago
    with db.open("rb") as fh:
        if fh.read(16) != SQLITE_MAGIC:
            raise UsageError(f"{db} is not an SQLite database (corrupt or another file); {fix}")
    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            damage = [r[0] for r in conn.execute("PRAGMA quick_check(3)")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{db} is damaged ({exc}); {fix}") from None
    if damage != ["ok"]:
        raise UsageError(f"{db} is damaged ({'; '.join(damage)}); {fix}")
    if version > SCHEMA_VERSION:
        return  # a newer toolkit's store: migrate() says to update the toolkit
    if (version == 0 and tables) or (version > 0 and not tables >= STORE_TABLES):
        raise UsageError(f"{db} is another schema's database (user_version {version}, tables "
                         f"{', '.join(sorted(tables)) or 'none'}), not a results store; {fix}")


def check_writable(db: Path) -> None:
    """UsageError naming the file and the fix unless the store ``db`` (when present) and its directory
    (SQLite writes its journal beside it) can be written; nothing is changed."""
    from sparkllm.outdir import OutputRefused, probe_writable

    try:
        probe_writable(db.parent, "the results directory")
    except OutputRefused as exc:
        raise UsageError(str(exc)) from None
    if not db.is_file():
        return
    try:
        os.close(os.open(db, os.O_RDWR))
    except OSError as exc:
        raise UsageError(f"{db} cannot be written ({exc.strerror}): make it writable (`chmod u+w {db}`; an "
                         f"immutable file: `chattr -i {db}`) or pass another results directory") from None


def _create_store(db: Path) -> None:
    """A new store with its whole schema, built in a temporary file and linked into place, so no other
    writer ever sees it empty or half made; a store another writer linked first is kept (theirs wins)."""
    tmp = db.with_name(f".{db.name}.new-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        conn = sqlite3.connect(tmp)
        try:
            migrate(conn)
        finally:
            conn.close()
        fsync_file(tmp)
        try:
            os.link(tmp, db)  # never replaces: FileExistsError when another writer was first
        except FileExistsError:
            return
        except OSError:
            return  # no hard links here: SQLite creates it, the schema under migrate()'s write lock
        fsync_dir(db.parent)
    finally:
        tmp.unlink(missing_ok=True)
        for suffix in ("-journal", "-wal", "-shm"):
            tmp.with_name(tmp.name + suffix).unlink(missing_ok=True)


def open_store(directory: Path, write: bool = True) -> sqlite3.Connection:
    """The store of a directory (created when absent); UsageError for a file that is not one, or, with
    ``write``, one that cannot be written (named with the fix)."""
    check_store(directory / STORE_NAME)
    if write:
        check_writable(directory / STORE_NAME)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / STORE_NAME).exists():
        _create_store(directory / STORE_NAME)
    conn = sqlite3.connect(directory / STORE_NAME, timeout=30)
    conn.row_factory = sqlite3.Row
    migrate(conn)
    return conn


def headline_e2e(doc: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """(mean, 95 % low, 95 % high) of a run's end-to-end tok/s: the records profile's mean over passes,
    else the mean over requests (None for a run of a toolkit before the profiles)."""
    rec = doc.get("records") or {}
    if rec.get("tok_s_mean") is not None:
        return rec["tok_s_mean"], rec.get("ci95_low"), rec.get("ci95_high")
    d = (doc.get("summary") or {}).get("e2e_tok_s") or {}
    return d.get("mean"), d.get("ci95_low"), d.get("ci95_high")


def store_run(conn: sqlite3.Connection, doc: dict[str, Any]) -> bool:
    """Insert one run document; returns False if that run id is already stored (idempotent).
    Documents of schema 1 (before load, depth, outputs and telemetry), 2 (before the request-rate mode) and
    3 (before the profiles: stored as profile decode) store NULL in the newer columns."""
    s, sp, meta = doc.get("summary", {}), doc.get("spec", {}), doc.get("meta", {})
    dec = s.get("decode_tok_s", {})
    rep = meta.get("repetition")
    tel = doc.get("telemetry") or {}
    gp = s.get("goodput") or {}
    targets = meta.get("goodput_targets_ms")
    row = (doc["run_id"], doc["label"], meta.get("method"), meta.get("config_hash"),
           int(rep) if rep is not None else None, int(bool(doc["valid"])), json.dumps(doc["problems"]),
           meta.get("started_utc"), meta.get("finished_utc"), meta.get("concurrency"), s.get("requests"),
           s.get("errors"), s.get("output_tokens"), dec.get("median"), dec.get("p5"), dec.get("p95"),
           dec.get("mean"), s.get("ttft_s", {}).get("median"), s.get("tpot_ms", {}).get("median"),
           s.get("tokens_per_chunk", {}).get("median"), sp.get("acceptance_rate"),
           sp.get("mean_acceptance_length"), sp.get("effective_tokens_per_step"), json.dumps(doc),
           meta.get("input_depth"), (s.get("token_weighted") or {}).get("output_tok_s_wall"),
           tel.get("j_per_output_token"), json.dumps(doc.get("warnings") or []), meta.get("request_rate"),
           (meta.get("rate") or {}).get("completed_rate_req_s"),
           json.dumps(targets, sort_keys=True) if targets else None, gp.get("share"), gp.get("rate_req_s"),
           meta.get("profile") or "decode", *headline_e2e(doc))
    with conn:
        cur = conn.execute(f"INSERT OR IGNORE INTO runs ({','.join(RUN_COLUMNS)}) "
                           f"VALUES ({','.join('?' * len(row))})", row)
        if cur.rowcount == 0:
            return False
        conn.executemany(
            f"INSERT OR IGNORE INTO requests ({','.join(REQUEST_COLUMNS)}) "
            f"VALUES ({','.join('?' * len(REQUEST_COLUMNS))})",
            [(doc["run_id"], *(int(bool(r["ok"])) if c == "ok" else r.get(c) for c in REQUEST_COLUMNS[1:]))
             for r in doc.get("requests", [])])
    return True


def record_output_checks(conn: sqlite3.Connection, checks: Sequence[dict[str, Any]]) -> None:
    """Replace the stored output check of each run named (written by the report, which computes them)."""
    with conn:
        conn.executemany(
            "INSERT OR REPLACE INTO output_checks VALUES (?,?,?,?,?,?,?,?,?)",
            [(c["run_id"], c.get("baseline_run_id"), c.get("compared"), c.get("identical_share"),
              c.get("median_prefix_share"), c.get("floor_identical_share"),
              c.get("floor_median_prefix_share"),
              int(bool(c["differs"])), utc_now()) for c in checks])


def atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, json.dumps(obj, indent=1, sort_keys=False).encode("utf-8"))


def is_run_doc(obj: Any) -> bool:
    return isinstance(obj, dict) and {"run_id", "label", "valid", "problems", "summary"} <= obj.keys()


def import_runs(paths: Sequence[Path], store_dir: Path) -> tuple[int, int]:
    """Copy run JSON files into store_dir and insert them into its SQLite; (added, skipped)."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise UsageError(f"{p} does not exist; pass run JSON files or directories holding them")
    conn = open_store(store_dir)
    added = skipped = 0
    try:
        for f in files:
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise SystemExit(f"import: {f} is not valid JSON ({exc})") from exc
            if not is_run_doc(doc):
                continue
            target = store_dir / f"{doc['run_id']}.json"
            if not target.exists():
                atomic_write_json(target, doc)
            if store_run(conn, doc):
                added += 1
            else:
                skipped += 1
    finally:
        conn.close()
    return added, skipped


def find_run(store_dir: Path, config_hash: str, repetition: int) -> str | None:
    """Run id of a valid stored run measured with this configuration hash and repetition, if any."""
    db = store_dir / STORE_NAME
    if not db.is_file():
        return None
    conn = open_store(store_dir)
    try:
        row = conn.execute("SELECT run_id FROM runs WHERE valid = 1 AND config_hash = ? AND repetition = ? "
                           "ORDER BY started_utc LIMIT 1", (config_hash, repetition)).fetchone()
    finally:
        conn.close()
    return row["run_id"] if row else None
