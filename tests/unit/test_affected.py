"""tests/harness/affected.py: the molecule scenarios a change touches (make test-affected)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import affected as af

ROOT = Path(__file__).resolve().parents[2]
ALL = ["site", "vllm_build", "serve", "cluster", "model", "ops", "bench", "metrics", "preflight"]


def test_every_scenario_of_make_test_is_known() -> None:
    """The list above is the Makefile's SCENARIOS (a new scenario must be mapped too)."""
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("SCENARIOS ?="))
    assert line.split("?=")[1].split() == ALL


def test_scenarios_run_the_roles_their_playbooks_name() -> None:
    roles, books = af.scenario_uses("ops")
    assert {"serve", "spark_ops", "spark_tools", "preflight"} <= roles  # preflight: an include_role
    assert "playbooks/ops.yml" in books and "site.yml" not in books
    roles, books = af.scenario_uses("site")
    assert roles == {p.name for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir()}  # site.yml: all
    assert "site.yml" in books
    assert af.scenario_uses("bench")[0] == {"bench", "spark_tools"}


@pytest.mark.parametrize(("path", "want"), [
    ("roles/serve/tasks/main.yml", ["site", "serve", "ops"]),
    ("roles/bench/defaults/main.yml", ["site", "bench"]),
    ("molecule/bench/converge.yml", ["bench"]),
    ("playbooks/monitoring.yml", ["site", "cluster", "metrics"]),
    ("templates/prometheus.yml.j2", ["site", "cluster", "metrics"]),
    ("tests/fixtures/standin_server/app.py", ["site", "serve", "cluster", "ops", "bench", "metrics"]),
    ("group_vars/all/main.yml", ALL),
    ("filter_plugins/spark_methods.py", ALL),
    ("molecule/_shared/host_probe.py", ALL),
    ("tests/harness/run_molecule.sh", ALL),
    ("a/new/top/level/file", ALL),
    ("docs/testing.md", []),
    ("roles/serve/README.md", []),
    ("tests/unit/test_affected.py", []),
])
def test_a_changed_path_maps_to_the_scenarios_that_use_it(path: str, want: list[str]) -> None:
    assert af.affected([path], ALL) == want


def test_the_answer_keeps_the_given_order_and_choice() -> None:
    assert af.affected(["roles/serve/tasks/main.yml", "roles/bench/tasks/main.yml"], ["bench", "serve"]) == [
        "bench", "serve"]
    assert af.affected(["roles/serve/tasks/main.yml"], ["bench", "preflight"]) == []


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_changed_paths_are_the_work_tree_against_the_base(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    (tmp_path / "b.txt").write_text("1")
    _git(tmp_path, "add", "b.txt")
    _git(tmp_path, "commit", "-q", "-m", "two")
    assert af.changed_paths("HEAD", tmp_path) == []
    (tmp_path / "a.txt").write_text("2")
    (tmp_path / "new.txt").write_text("untracked")
    assert sorted(af.changed_paths("HEAD", tmp_path)) == ["a.txt", "new.txt"]
    assert sorted(af.changed_paths("HEAD~1", tmp_path)) == ["a.txt", "b.txt", "new.txt"]
    with pytest.raises(af.UsageError):
        af.changed_paths("no-such-ref", tmp_path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests/harness/affected.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_cli_prints_the_scenarios_and_exits_by_the_house_rule() -> None:
    done = _cli("--paths", "roles/bench/tasks/main.yml", "--", "site", "bench", "serve")
    assert (done.returncode, done.stdout) == (0, "site bench\n")
    done = _cli("--paths", "docs/x.md", "--", "site")
    assert (done.returncode, done.stdout) == (0, "\n")
    done = _cli("--paths", "x", "--", "nonesuch")
    assert done.returncode == 2 and "no scenario nonesuch" in done.stderr
    done = _cli("--base", "no-such-ref-anywhere", "site")
    assert done.returncode == 2 and "BASE must be a commit" in done.stderr
