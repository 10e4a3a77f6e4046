"""roles/vllm_build/files/sparkllm-image-build: output in LOG, exit status in LOG.rc, and one build per
LOG at a time (flock on LOG.lock): a second one exits 75 at once and leaves the running build's log alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

WRAPPER = Path(__file__).resolve().parents[2] / "roles" / "vllm_build" / "files" / "sparkllm-image-build"
pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is not installed")


@pytest.fixture
def fake_docker(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text('#!/bin/sh\nwhile [ ! -f "$FAKE_GO" ]; do sleep 0.05; done\n'
                      'echo "fake docker $*"\nexit "${FAKE_RC:-0}"\n')
    docker.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GO": str(tmp_path / "go")}


def test_log_and_rc(tmp_path, fake_docker):
    (tmp_path / "go").touch()
    log = tmp_path / "build.log"
    res = subprocess.run([str(WRAPPER), str(log), "build", "x"], env={**fake_docker, "FAKE_RC": "3"},
                         check=False)
    assert res.returncode == 3
    assert "fake docker build x" in log.read_text()
    assert (tmp_path / "build.log.rc").read_text().strip() == "3"


def test_second_build_into_the_same_log_is_refused_while_the_first_runs(tmp_path, fake_docker):
    log = tmp_path / "build.log"
    first = subprocess.Popen([str(WRAPPER), str(log), "build", "first"], env=fake_docker)
    for _ in range(100):
        if log.exists():
            break
        time.sleep(0.05)
    second = subprocess.run([str(WRAPPER), str(log), "build", "second"], env=fake_docker,
                            capture_output=True, text=True, check=False)
    assert second.returncode == 75
    assert "another build writing" in second.stderr
    (tmp_path / "go").touch()
    assert first.wait(timeout=30) == 0
    text = log.read_text()
    assert "fake docker build first" in text and "second" not in text
    assert not (tmp_path / "build.log.prev").exists()  # the refused run did not rotate the log
    # and once the first is done, a new build runs
    third = subprocess.run([str(WRAPPER), str(log), "build", "third"], env=fake_docker, check=False)
    assert third.returncode == 0


def _wait_for(path: Path, text: str = "", timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never held {text!r}")


def test_a_failed_job_beside_the_build_stops_it(tmp_path, fake_docker):
    """The model download beside the build failed: the build is stopped at once (not after its hour)."""
    log, status = tmp_path / "build.log", tmp_path / "status.json"
    status.write_text('{\n  "state": "running",\n  "pid": 1\n}\n')
    build = subprocess.Popen([str(WRAPPER), str(log), "build", "x"],
                             env={**fake_docker, "SPARKLLM_BUILD_WATCH": str(status)})
    _wait_for(log, "# docker build x")
    time.sleep(1.5)
    assert build.poll() is None, "a running job must not stop the build"
    status.write_text('{\n  "state": "failed",\n  "error": "sha256 mismatch"\n}\n')
    rc = build.wait(timeout=15)  # the fake docker would wait forever for FAKE_GO
    assert rc not in (0, 75)
    text = log.read_text()
    assert f"stopping the build: the job beside it failed (status {status})" in text
    assert f"finished rc={rc}" in text
    assert (tmp_path / "build.log.rc").read_text().strip() == str(rc)


def test_a_build_watching_a_job_that_goes_well_finishes_normally(tmp_path, fake_docker):
    log, status = tmp_path / "build.log", tmp_path / "status.json"
    status.write_text('{"state": "done"}\n')
    build = subprocess.Popen([str(WRAPPER), str(log), "build", "x"],
                             env={**fake_docker, "SPARKLLM_BUILD_WATCH": str(status)})
    _wait_for(log, "# docker build x")
    (tmp_path / "go").touch()
    assert build.wait(timeout=15) == 0
    assert "stopping" not in log.read_text()
    assert (tmp_path / "build.log.rc").read_text().strip() == "0"


def test_sigterm_to_the_wrapper_stops_docker_and_records_the_status(tmp_path, fake_docker):
    log = tmp_path / "build.log"
    build = subprocess.Popen([str(WRAPPER), str(log), "build", "x"], env=fake_docker)
    _wait_for(log, "# docker build x")
    build.terminate()
    rc = build.wait(timeout=15)
    assert rc != 0
    assert (tmp_path / "build.log.rc").read_text().strip() not in ("", "0")
    # docker (the fake) is gone too: nothing of the build is left running
    ps = subprocess.run(["pgrep", "-f", f"{tmp_path}/bin/docker"], capture_output=True, text=True,
                        check=False)
    assert ps.stdout.strip() == "", ps.stdout
