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
