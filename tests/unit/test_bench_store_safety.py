"""The results store under concurrent writers and when it cannot be used (issue 46 items 5 and 7).

Several benchmarks may start at once on a new store (the bench role on two Sparks, a sweep beside a
manual run): none may be refused, none may lose its row. A store that is damaged or cannot be written is
named with its path and the fix, before any work.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import bench
import pytest
from sparkllm.bench import store as bench_store

from tests.unit.bench_helpers import fake_doc

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); import bench; print('ready', flush=True); "
         "sys.stdin.readline(); sys.exit(bench.main(['import', sys.argv[2], '--store', sys.argv[3]]))")


def _start_together(store: Path, docs: list[Path]) -> list[subprocess.CompletedProcess]:
    """``bench.py import`` of each run file into one store, every process released at the same moment
    (each waits on its stdin once it has imported everything: a barrier without timing)."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(SCRIPTS), str(d), str(store)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for d in docs]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


@pytest.mark.parametrize("legacy_empty_file", [False, True])
def test_writers_started_at_once_on_a_new_store_all_keep_their_rows(tmp_path: Path,
                                                                    legacy_empty_file: bool) -> None:
    """Four benchmarks on a new store: one was refused ("results.sqlite is empty (0 bytes)") and its row
    lost. Each round: 6 writers at once; every one exits 0 and every row is there. ``legacy_empty_file``:
    the 0-byte file an older writer leaves the moment it opens a new store is a store being created, not a
    foreign file."""
    n, rounds = 6, 3
    for rnd in range(rounds):
        store = tmp_path / f"store{rnd}"
        store.mkdir()
        if legacy_empty_file:
            (store / bench_store.STORE_NAME).touch()
        docs = []
        for i in range(n):
            d = tmp_path / f"in{rnd}-{i}"
            d.mkdir()
            (d / "run.json").write_text(json.dumps(fake_doc(f"m{i}", 1, [10.0, 11.0], run_id=f"r{rnd}-{i}")))
            docs.append(d / "run.json")
        results = _start_together(store, docs)
        assert [r.returncode for r in results] == [0] * n, [r.stderr for r in results]
        db = sqlite3.connect(store / bench_store.STORE_NAME)
        ids = {r[0] for r in db.execute("SELECT run_id FROM runs")}
        assert ids == {f"r{rnd}-{i}" for i in range(n)}
        version = db.execute("PRAGMA user_version").fetchone()[0]
        db.close()
        assert version == bench_store.SCHEMA_VERSION
        assert not [p.name for p in store.iterdir() if p.name.startswith(".")]  # no temporary store left


def test_migrating_an_old_store_twice_at_once_does_not_add_a_column_twice(tmp_path: Path) -> None:
    """Two writers both read version 1 and both ran migration 2: the second ALTER TABLE failed ("duplicate
    column name"). Here the rival migrates right after this writer read the version (the interleaving two
    processes produce); each migration re-reads the version inside its own write transaction."""
    db = tmp_path / bench_store.STORE_NAME
    first = sqlite3.connect(db)
    first.executescript(bench_store.MIGRATIONS[0][2])
    first.execute("PRAGMA user_version = 1")
    first.commit()
    first.close()
    rival = sqlite3.connect(db, timeout=30)

    class Racing(sqlite3.Connection):
        def execute(self, sql: str, *args: object):  # type: ignore[override]
            cur = super().execute(sql, *args)
            if sql.startswith("PRAGMA user_version") and not sql.count("="):
                row = cur.fetchone()
                if not rival.in_transaction and rival.execute("PRAGMA user_version").fetchone()[0] == 1:
                    bench_store.migrate(rival)  # between this writer's read and its write

                class Read:
                    def fetchone(self) -> tuple:
                        return row
                return Read()
            return cur

    late = sqlite3.connect(db, timeout=30, factory=Racing)
    assert bench_store.migrate(late) == bench_store.SCHEMA_VERSION
    cols = [r[1] for r in late.execute("PRAGMA table_info(runs)")]
    assert len(cols) == len(set(cols)) and "input_depth" in cols
    late.close()
    rival.close()


def _damage(db: Path) -> None:
    """Overwrite the store's last page (a data page) with garbage, as a torn write or a bad sector does."""
    size = db.stat().st_size
    with db.open("r+b") as fh:
        fh.seek(size - 4096)
        fh.write(b"\xde\xad" * 2048)


def test_a_damaged_store_page_is_named_with_the_fix_before_any_work(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    conn = bench_store.open_store(store)
    for i in range(40):
        bench_store.store_run(conn, fake_doc(f"m{i}", 1, [10.0] * 20, run_id=f"r{i}"))
    conn.close()
    db = store / bench_store.STORE_NAME
    _damage(db)
    doc = tmp_path / "new.json"
    doc.write_text(json.dumps(fake_doc("late", 1, [10.0], run_id="late")))
    rc = bench.main(["import", str(doc), "--store", str(store)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(db) in err[0] and "damaged" in err[0] and f"bench.py import {store}" in err[0], err[0]
    assert not (store / "late.json").exists()  # refused before any work


def _immutable(path: Path) -> bool:
    """Make ``path`` unwritable even for root (chattr +i, as the campaign did); False where not possible."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        return True
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    return r.returncode == 0


def test_an_unwritable_store_file_is_named_with_the_fix_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    bench_store.open_store(store).close()
    db = store / bench_store.STORE_NAME
    if not _immutable(db):
        pytest.skip("cannot make a file immutable here (chattr +i needs CAP_LINUX_IMMUTABLE)")
    try:
        doc = tmp_path / "new.json"
        doc.write_text(json.dumps(fake_doc("late", 1, [10.0], run_id="late")))
        rc = bench.main(["import", str(doc), "--store", str(store)])
    finally:
        subprocess.run(["chattr", "-i", str(db)], capture_output=True)
        db.chmod(0o644)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(db) in err[0] and "cannot be written" in err[0] and "chattr -i" in err[0], err[0]
