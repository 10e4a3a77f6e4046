"""Upstream PRs carried as the diff of their commit (spark_vllm_variants.<v>.extra_prs entries with
diff_sha256): the build steps of the real templates/Dockerfile.j2 run in bash against a local git repository
standing in for vLLM's (a release tag; on main, a move of the file and then the PR's commit, the shape of
PR 38325 after the csrc/libtorch_stable move), and the role's pin check (roles/vllm_build/vars/main.yml
_vllm_build_pin_errors, a call of filter_plugins/spark_build.py) rendered with the role's defaults. The real
PR against the real 0.19.1 source is tests/contract/test_upstream_pr_diffs_contract.py."""

from __future__ import annotations

import ast
import copy
import hashlib
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from spark_build import FilterModule as BuildFilters

from tests.unit.test_dockerfile import ROLE, VARIANTS, ctx, lock_files, unpinned
from tests.unit.test_templates import defaults, env, render

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]
RELEASE = "void f(Tensor const& a,\n       Tensor const& b) {\n  int x = 1;\n  g(a, b);\n}\n"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> tuple[Path, str]:
    """A vLLM stand-in: tag v9.9.9 has src/k.cuh; main then moves it to new/src/k.cuh with stable::Tensor, and
    the PR's commit (main's tip) changes a line whose context names stable::Tensor."""
    repo = tmp_path_factory.mktemp("upstream")
    _git(repo, "init", "-q")
    (repo / "src").mkdir()
    (repo / "src" / "k.cuh").write_text(RELEASE)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "release")
    _git(repo, "tag", "v9.9.9")
    (repo / "new" / "src").mkdir(parents=True)
    _git(repo, "mv", "src/k.cuh", "new/src/k.cuh")
    (repo / "new" / "src" / "k.cuh").write_text(RELEASE.replace("Tensor", "stable::Tensor"))
    _git(repo, "commit", "-qam", "move to the stable ABI")
    moved = RELEASE.replace("Tensor", "stable::Tensor")
    (repo / "new" / "src" / "k.cuh").write_text(moved.replace("x = 1", "x = 2"))
    _git(repo, "commit", "-qam", "the PR (#1)")
    return repo, _git(repo, "rev-parse", "HEAD")


def _diff_sha256(repo: Path, sha: str) -> str:
    args = defaults("vllm_build")["vllm_build_pr_diff_args"]
    out = subprocess.run(["git", "diff", *args, f"{sha}^1", sha], cwd=repo, capture_output=True, check=True)
    return hashlib.sha256(out.stdout).hexdigest()


def _dockerfile(repo_url: str, **cfg) -> str:
    c = ctx("v0_19_1", **cfg)
    c["vllm_build_repo_url"] = repo_url
    c["vllm_build_from_source"] = False
    c["_vllm_build_lock"] = lock_files("v0_19_1", from_source=True)
    return render("Dockerfile.j2", **c)


def _build_steps(dockerfile: str) -> list[str]:
    """The build stage's RUN steps from the clone to the last carried PR (before the build patches)."""
    part = dockerfile.split("FROM base AS build", 1)[1].split("# Build against the torch", 1)[0]
    return re.findall(r"(?ms)^RUN (.*?[^\\])$", part)


def _run_build_steps(upstream_repo: Path, work: Path, **cfg) -> subprocess.CompletedProcess:
    work.mkdir()
    script = "\n".join(f"( {s} ) || exit $?" for s in _build_steps(_dockerfile(str(upstream_repo), **cfg)))
    return subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=work, capture_output=True, text=True)


def _entry(repo: Path, sha: str, **kw) -> dict:
    return {"pr": 1, "sha": sha, "diff_sha256": _diff_sha256(repo, sha),
            "rewrite": [["new/src/", "src/"], ["stable::Tensor", "Tensor"]], **kw}


def test_the_build_applies_the_pinned_diff_of_a_main_commit_to_the_release(upstream, tmp_path):
    repo, sha = upstream
    res = _run_build_steps(repo, tmp_path / "w", ref="v9.9.9", extra_prs=[_entry(repo, sha)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "w" / "src" / "k.cuh").read_text() == RELEASE.replace("x = 1", "x = 2")
    assert not (tmp_path / "w" / "new").exists()  # the diff only, not main's move that came before it
    assert "sparkllm: applied PR #1" in res.stdout


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"diff_sha256": "0" * 64}, "SPARKLLM-PR-FAILED: #1 (the diff of commit {sha} has sha256"),
        ({"rewrite": [["new/src/", "src/"]]}, "SPARKLLM-PR-FAILED: #1 (the diff of commit {sha} does not"),
        ({"rewrite": []}, "SPARKLLM-PR-FAILED: #1 (the diff of commit {sha} does not apply to v9.9.9)"),
        ({"sha": "f" * 40}, "SPARKLLM-PR-FAILED: #1 (cannot fetch commit " + "f" * 40),
    ],
)
def test_the_build_stops_with_a_marker_when_the_diff_is_not_the_pinned_one_or_does_not_apply(
        upstream, tmp_path, change, needle):
    repo, sha = upstream
    res = _run_build_steps(repo, tmp_path / "w", ref="v9.9.9", extra_prs=[{**_entry(repo, sha), **change}])
    assert res.returncode != 0
    assert needle.format(sha=sha) in res.stdout + res.stderr  # run_build.yml greps the marker from the log
    assert (tmp_path / "w" / "src" / "k.cuh").read_text() == RELEASE  # nothing half-applied


def test_the_catalogue_renders_pr_38325_as_a_pinned_diff():
    text = _dockerfile("https://github.com/vllm-project/vllm.git")
    (entry,) = VARIANTS["v0_19_1"]["extra_prs"]
    args = " ".join(defaults("vllm_build")["vllm_build_pr_diff_args"])
    assert f"git diff {args} {entry['sha']}^1 {entry['sha']} > \"$d\"" in text
    assert f'[ "$got" = "{entry["diff_sha256"]}" ]' in text
    assert '"$d" csrc/libtorch_stable/ csrc/ torch::stable::Tensor torch::Tensor' in text
    assert "for spec in" not in text  # nothing is merged
    assert text.startswith("# vLLM v0.19.1 + PR 38325 for the DGX Spark")
    assert unpinned(text) == []


# ------------------------------------------------------------------ the role's pin check


def pin_errors(variants: dict, overrides: dict | None = None, from_source: bool = False) -> list[str]:
    raw = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["_vllm_build_pin_errors"]
    # every variant keyed: this test's Jinja has no Ansible templar, whose `default` also covers a missing key
    c = {**defaults("vllm_build"), "_vllm_build_variants": sorted(variants), "spark_vllm_variants": variants,
         "vllm_build_variant_overrides": {v: {} for v in variants} | (overrides or {}),
         "vllm_build_images": {}, "vllm_build_from_source": from_source}
    e = env()
    e.filters.update(BuildFilters().filters())
    return ast.literal_eval(e.from_string(raw).render(**c).strip())


def _with_pr(**change) -> dict:
    variants = copy.deepcopy(VARIANTS)
    variants["v0_19_1"]["extra_prs"] = [{**variants["v0_19_1"]["extra_prs"][0], **change}]
    return variants


def test_the_catalogue_passes_the_pin_check():
    assert pin_errors(VARIANTS) == []


def test_a_wheel_install_refuses_extra_prs_instead_of_ignoring_them():
    errors = pin_errors(VARIANTS, {"v0_19_1": {"install": "wheel"}})
    assert len(errors) == 1 and "v0_19_1 installs the prebuilt vLLM 0.19.1 wheel" in errors[0]
    assert "PR #38325" in errors[0] and "{v0_19_1: {extra_prs: []}}" in errors[0]
    assert pin_errors(VARIANTS, {"v0_19_1": {"install": "wheel", "extra_prs": []}}) == []
    # vllm_build_from_source compiles it after all
    assert pin_errors(VARIANTS, {"v0_19_1": {"install": "wheel"}}, from_source=True) == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"diff_sha256": "abc"}, "has diff_sha256 abc, not a sha256 (64 hex)"),
        ({"rewrite": "csrc/libtorch_stable/"}, "must be a list of [from, to] pairs"),
        ({"rewrite": [["csrc/libtorch_stable/"]]}, "must be a list of [from, to] pairs"),
        ({"rewrite": [["csrc/libtorch_stable/", ""]]}, "must be a list of [from, to] pairs"),
        ({"rewrite": [["csrc/libtorch_stable/", 3]]}, "must be a list of [from, to] pairs"),
        ({"sha": "refs/pull/38325/head"}, "must be {pr: N, sha: <40-hex commit>}"),
    ],
)
def test_the_pin_check_refuses_a_malformed_diff_entry(change, needle):
    errors = pin_errors(_with_pr(**change))
    assert len(errors) == 1 and needle in errors[0], errors


def test_a_rewrite_needs_a_pinned_diff():
    variants = _with_pr()
    del variants["v0_19_1"]["extra_prs"][0]["diff_sha256"]
    (error,) = pin_errors(variants)
    assert "has rewrite but no diff_sha256" in error
