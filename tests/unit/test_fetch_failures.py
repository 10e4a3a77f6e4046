"""fetch_checkpoint.py when things go wrong: no network, a missing parent, Ctrl-C, a failure midway.

Every case asserts the exit code, one final stderr line (no traceback) naming the problem and the fix,
and what is left on disk: nothing that a rerun would not reuse, nothing the tool did not create.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fetch_checkpoint as fc
import httpx
import pytest
from sparkllm.fetch import common as fetch_common
from sparkllm.fetch import hub as fetch_hub
from sparkllm.fetch import mirror as fetch_mirror
from sparkllm.outdir import MARKER

from tests.fixtures.make_checkpoints import GenConfig, generate
from tests.fixtures.range_server import RangeServer
from tests.unit.test_bad_inputs import tree

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_checkpoint.py"
REPO = "Qwen/Qwen3.5-122B-A10B-FP8"
FAST = ("--retries", "2", "--retry-backoff-s", "0")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def run(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=120, **kw)  # fmt: skip


def last_line(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines, r.stderr
    return lines[-1]


def remote(mode: str, dest: Path, endpoint: str) -> list[str]:
    return [mode, "--repo", REPO, "--revision", "main", "--dest", str(dest), "--endpoint", endpoint, *FAST]


def make_mirror(root: Path, n: int = 4, size: int = 1 << 18) -> Path:
    src = root / "mirror"
    src.mkdir()
    for i in range(n):
        (src / f"part-{i}.bin").write_bytes(bytes([i]) * size)
    fc.write_manifest(src, True)
    return src


# ------------------------------------------------------------------ no network


@pytest.mark.parametrize("mode", ["hub", "full", "fp8-extract"])
def test_offline_ends_in_one_line_with_the_rerun(tmp_path: Path, mode: str) -> None:
    port = closed_port()
    dest = tmp_path / "d" / ("x.safetensors" if mode == "fp8-extract" else "")
    r = run(*remote(mode, dest, f"http://127.0.0.1:{port}"))
    line = last_line(r)
    assert r.returncode == 1, r.stderr
    assert line.startswith("fetch_checkpoint: error: ")
    assert f"127.0.0.1:{port} refused the connection" in line and "gave up after 3 attempts" in line
    assert f"rerun to resume: fetch_checkpoint.py {mode} --repo {REPO}" in line
    assert r.stderr.count("transient: ") == 2  # two retries, then the end
    assert not (tmp_path / "d").exists()  # nothing created


def test_dns_failure_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def no_dns(*_a, **_k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    for mode in ("hub", "fp8-extract"):
        dest = tmp_path / mode / ("x.st" if mode == "fp8-extract" else "")
        assert fc.main(remote(mode, dest, "http://hub.example.invalid")) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "the host name hub.example.invalid does not resolve (DNS failure" in line, line
        assert "rerun to resume" in line and not (tmp_path / mode).exists()


def test_network_problem_phrases() -> None:
    h = "hub:443"
    assert "did not answer in time" in fetch_common.network_problem(httpx.ReadTimeout("timed out"), h)
    assert "reset the connection" in fetch_common.network_problem(ConnectionResetError(104, "reset"), h)
    assert "closed the connection early" in fetch_common.network_problem(
        httpx.RemoteProtocolError("Server disconnected without sending a response."), h
    )
    assert "is unreachable" in fetch_common.network_problem(OSError(errno.ENETUNREACH, "unreachable"), h)
    assert fetch_common.network_problem(ValueError("bad json"), h) is None


def test_hub_errors_mapped() -> None:
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    req = httpx.Request("GET", "http://hub/api/models/a/b")
    e503 = HfHubHTTPError("503", response=httpx.Response(503, request=req))
    assert isinstance(fetch_hub.hub_error(e503, "a/b", "hub"), fetch_common.TransientError)
    e404 = RepositoryNotFoundError("nope", response=httpx.Response(404, request=req))
    out = fetch_hub.hub_error(e404, "a/b", "hub")
    assert type(out) is fetch_common.FetchError and "--token-file or HF_TOKEN" in str(out)
    try:  # hf_hub_download's wrapper around a failed HEAD: the cause decides
        try:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        except httpx.ConnectError as cause:
            raise LocalEntryNotFoundError("check your connection") from cause
    except LocalEntryNotFoundError as exc:
        mapped = fetch_hub.hub_error(exc, "a/b", "hub")
    assert isinstance(mapped, fetch_common.TransientError) and "refused" in mapped.problem


def test_hub_call_retried_then_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    fails = {"n": 2}

    class FlakyApi:
        def __init__(self, endpoint: str, token: str | None) -> None:
            pass

        def model_info(self, repo: str, revision: str):
            if fails["n"]:
                fails["n"] -= 1
                raise httpx.ConnectError("[Errno 104] Connection reset by peer")
            return type("Info", (), {"sha": "9" * 40})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FlakyApi)
    client = fc.HfHubClient("o/r", "main", "http://hub", None, fetch_common.Retry(3, 0))
    assert client.pin() == "9" * 40 and client.retry.retried == 2


# ------------------------------------------------------------------ destinations


@pytest.mark.parametrize("mode", ["mirror", "hub", "fp8-extract"])
def test_missing_parent_refused_and_nothing_created(tmp_path: Path, mode: str) -> None:
    src = make_mirror(tmp_path, n=1, size=10)
    before = tree(tmp_path)
    dest = tmp_path / "nonexistent" / "parent" / "x"
    args = (["mirror", "--src", str(src), "--dest", str(dest)] if mode == "mirror"
            else remote(mode, dest, f"http://127.0.0.1:{closed_port()}"))  # fmt: skip
    r = run(*args)
    line = last_line(r)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "parent" in line and "does not exist" in line and "mkdir -p" in line, line
    assert tree(tmp_path) == before


def test_file_as_parent_is_named(tmp_path: Path) -> None:
    src = make_mirror(tmp_path, n=1, size=10)
    f = tmp_path / "a-file"
    f.write_text("mine")
    for dest in (f / "x", f / "sub" / "x"):
        r = run("mirror", "--src", str(src), "--dest", str(dest))
        line = last_line(r)
        assert r.returncode == 2 and f"{f} is a file, not a directory" in line and "Errno" not in line, line
    assert f.read_text() == "mine"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--retries", "-1"], "--retries -1: must be 0"),
        (["--retry-backoff-s", "-2"], "--retry-backoff-s -2: must be 0 or more"),
        (["--pattern", "("], "--pattern '(': not a regular expression"),
        (["--endpoint", "ftp://x"], "--endpoint 'ftp://x': not an http(s) URL"),
        (["--repo", "a b/c"], "--repo 'a b/c': not a Hub repo id"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, extra: list[str], needle: str) -> None:
    args = [
        "fp8-extract",
        "--repo",
        REPO,
        "--revision",
        "main",
        "--dest",
        str(tmp_path / "d" / "x.st"),
        *extra,
    ]
    r = run(*args)
    assert r.returncode == 2 and needle in last_line(r), r.stderr
    assert not (tmp_path / "d").exists()


def test_empty_token_file_is_a_usage_error(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.write_text("\n")
    r = run(
        "hub", "--repo", "a/b", "--revision", "main", "--dest", str(tmp_path / "d"), "--token-file", str(tok)
    )
    assert r.returncode == 2 and "--token-file is empty" in last_line(r)


# ------------------------------------------------------------------ cleanup after a failure


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_failed_fetch_removes_the_directory_it_created(tmp_path: Path) -> None:
    src = make_mirror(tmp_path, n=2, size=1000)
    corrupt(src / "part-0.bin")
    dest = tmp_path / "dest"
    r = run("mirror", "--src", str(src), "--dest", str(dest), *FAST)
    assert r.returncode == 1 and "sha256 differs" in last_line(r)
    assert not dest.exists()  # it held only the owner marker: gone


def test_failed_fetch_keeps_what_it_verified(tmp_path: Path) -> None:
    src = make_mirror(tmp_path, n=2, size=1000)
    corrupt(src / "part-1.bin")
    dest = tmp_path / "dest"
    r = run("mirror", "--src", str(src), "--dest", str(dest), *FAST)
    line = last_line(r)
    assert r.returncode == 1 and f"1 verified file(s) kept in {dest}" in line, line
    assert (dest / "part-0.bin").is_file() and not (dest / "part-1.bin").exists()
    assert not [p for p in dest.iterdir() if "incomplete" in p.name]


def test_failed_fetch_leaves_a_directory_it_did_not_create(tmp_path: Path) -> None:
    src = make_mirror(tmp_path, n=1, size=1000)
    corrupt(src / "part-0.bin")
    dest = tmp_path / "users-empty-dir"
    dest.mkdir()
    r = run("mirror", "--src", str(src), "--dest", str(dest), *FAST)
    assert r.returncode == 1
    assert dest.is_dir() and list(dest.iterdir()) == []  # as it was: the marker it wrote is gone again


def test_fp8_extract_offline_creates_nothing_and_bad_range_cleans_up(tmp_path: Path) -> None:
    pair = generate(tmp_path / "src", GenConfig(layers=2, experts=2))
    dest = tmp_path / "ext" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO, mode="wrong") as srv:
        r = run(*remote("fp8-extract", dest, srv.endpoint))
    assert r.returncode == 1 and "wrong Content-Range" in last_line(r)
    assert not dest.parent.exists()


def test_mount_errors_retried_then_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_mirror(tmp_path, n=1, size=1000)
    real = fetch_mirror.copy_verified
    calls = {"n": 0}

    def stale(*a, **k):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(*a, **k)

    monkeypatch.setattr(fetch_mirror, "copy_verified", stale)
    out = fc.mirror_fetch(src, tmp_path / "ok", retry=fetch_common.Retry(3, 0))
    assert out["copied"] == 1 and calls["n"] == 3
    calls["n"] = -100
    with pytest.raises(fc.NetworkError) as exc:
        fc.mirror_fetch(src, tmp_path / "bad", retry=fetch_common.Retry(1, 0))
    assert "the mirror" in str(exc.value) and "Stale file handle" in str(exc.value)
    assert "check the mirror's mount" in str(exc.value)


# ------------------------------------------------------------------ Ctrl-C


@pytest.mark.parametrize(("sig", "rc"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_ends_in_one_line_and_resumes(tmp_path: Path, sig: int, rc: int) -> None:
    src = make_mirror(tmp_path, n=4, size=1 << 18)
    dest = tmp_path / "dest"
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), "mirror", "--src", str(src), "--dest", str(dest),
         "--max-rate", "600000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (dest / fetch_common.MIRROR_STATE).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, "finished before the signal: raise the file size or lower --max-rate"
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == rc, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    name = signal.Signals(sig).name
    assert (
        line.startswith(f"fetch_checkpoint: interrupted ({name}); ")
        and "rerun to resume: fetch_checkpoint.py mirror" in line
    )
    kept = json.loads((dest / fetch_common.MIRROR_STATE).read_text())
    assert 1 <= len(kept) < 4 and f"{len(kept)} verified file(s) kept" in line
    assert not [q for q in dest.iterdir() if "incomplete" in q.name]  # no temporary file left
    assert (dest / MARKER).is_file()
    r = run("mirror", "--src", str(src), "--dest", str(dest))
    assert r.returncode == 0 and json.loads(r.stdout)["copied"] == 4 - len(kept)  # resumed


# ------------------------------------------------------------------ standard library only on the Spark


def test_modes_run_without_site_packages(tmp_path: Path) -> None:
    """python -S (no site-packages: the Spark's system python3): mirror and fp8-extract work, hub ends
    in one line naming huggingface_hub and the venv."""

    def bare(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", str(SCRIPT), *args], capture_output=True, text=True,
                              timeout=60, env={"PATH": os.environ.get("PATH", "")})  # fmt: skip

    src = make_mirror(tmp_path, n=1, size=10)
    r = bare("mirror", "--src", str(src), "--dest", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    r = bare(*remote("fp8-extract", tmp_path / "e" / "x.st", f"http://127.0.0.1:{closed_port()}"))
    assert r.returncode == 1 and "refused the connection" in last_line(r)
    r = bare(*remote("hub", tmp_path / "h", f"http://127.0.0.1:{closed_port()}"))
    assert r.returncode == 1 and "hub and full need huggingface_hub" in last_line(r), r.stderr
    assert "/opt/sparkllm/venv" in last_line(r) and not (tmp_path / "h").exists()
