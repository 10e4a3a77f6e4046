"""Every upstream PR a build carries as a diff (spark_vllm_variants.<v>.extra_prs entries with diff_sha256)
applies to the real source of that variant's release, as the build applies it.

The diff is the one the build makes (tests/contract/vllm_prs.py: the commit's ``git diff`` with the role's
own options, checked against the pinned sha256, cached per machine); the tree is the release's pinned sdist
(scripts/sparkllm/lock/sources.py), whose files the diff touches are extracted into a scratch git repository.
"""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from sparkllm.lock import sources as vllm_sources

from tests.contract import vllm_prs

pytestmark = pytest.mark.vllm_contract

VARIANTS = yaml.safe_load(vllm_prs.METHODS.read_text())["spark_vllm_variants"]
CARRIED = vllm_prs.diff_prs()
IDS = [f"{v}-pr{p['pr']}" for v, p in CARRIED]


def _diff_text(entry: dict) -> str:
    try:
        return vllm_prs.pr_diff(entry).read_text()
    except vllm_prs.Unreachable as exc:
        pytest.skip(f"PR #{entry['pr']}: its commit cannot be fetched here and no pinned diff is cached "
                    f"({exc}); run tests/contract/setup_vllm_env.sh where github.com is reachable once")
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.fail(f"PR #{entry['pr']}: no pinned diff ({exc}); run tests/contract/setup_vllm_env.sh "
                    "where github.com is reachable once")


def _members(version: str) -> dict[str, tarfile.TarInfo]:
    top = f"vllm-{version}/"
    with tarfile.open(vllm_sources.sdist(version)) as tar:
        return {m.name[len(top):]: m for m in tar.getmembers() if m.isfile() and m.name.startswith(top)}


def _tree(version: str, paths: list[str], dest: Path) -> Path:
    """A git repository holding ``paths`` of the release's sdist (those present), at their release content."""
    top = f"vllm-{version}/"
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    with tarfile.open(vllm_sources.sdist(version)) as tar:
        for rel in paths:
            try:
                member = tar.getmember(top + rel)
            except KeyError:
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", version], cwd=dest, check=True)
    return dest


def _apply(repo: Path, diff: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", *extra, str(diff)], cwd=repo, capture_output=True, text=True)


def test_the_catalogue_carries_pr_38325_as_a_diff_on_0_19_1():
    assert [(v, p["pr"]) for v, p in CARRIED] == [("v0_19_1", 38325)]
    assert VARIANTS["v0_19_1"].get("install", "source") == "source"  # a csrc change needs the compile


@pytest.mark.parametrize(("variant", "entry"), CARRIED, ids=IDS)
def test_the_pinned_diff_applies_to_the_release_source(variant, entry, tmp_path):
    version = VARIANTS[variant]["version"]
    upstream = _diff_text(entry)
    text = vllm_prs.rewritten(upstream, entry.get("rewrite"))
    paths = vllm_prs.touched(text)
    assert paths, f"PR #{entry['pr']}: its diff changes no file"
    members = _members(version)
    missing = [p for p in paths if p not in members]
    assert not missing, f"PR #{entry['pr']} changes {missing}, which vLLM {version} does not have"
    diff = tmp_path / "pr.diff"
    diff.write_text(text)
    repo = _tree(version, paths, tmp_path / "src")
    check = _apply(repo, diff, "--check", "-v")
    assert check.returncode == 0, f"PR #{entry['pr']} does not apply to vLLM {version}:\n{check.stderr}"
    if entry.get("rewrite"):
        # each rename is needed: without it the upstream diff does not apply (else drop it from `rewrite`)
        for i in range(len(entry["rewrite"])):
            partial = entry["rewrite"][:i] + entry["rewrite"][i + 1:]
            (tmp_path / "partial.diff").write_text(vllm_prs.rewritten(upstream, partial))
            repo_i = _tree(version, vllm_prs.touched(vllm_prs.rewritten(upstream, partial)) + paths,
                           tmp_path / f"src{i}")
            assert _apply(repo_i, tmp_path / "partial.diff", "--check").returncode != 0, (
                f"PR #{entry['pr']} applies without the rename {entry['rewrite'][i]}: drop it")
    assert _apply(repo, diff).returncode == 0
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                            check=True)
    assert sorted(line[3:] for line in status.stdout.splitlines()) == sorted(paths)


def test_pr_38325_on_0_19_1_gives_the_0_26_0_kernel_dispatch(tmp_path):
    """0.19.1 with the carried diff has the swapAB dispatch 0.26.0 ships, up to the two renames and the one
    include 0.26.0 added later (its libtorch stable-ABI migration): carrying it is the upstream change."""
    (_variant, entry), = [(v, p) for v, p in CARRIED if p["pr"] == 38325]
    text = vllm_prs.rewritten(_diff_text(entry), entry["rewrite"])
    (path,) = vllm_prs.touched(text)
    (tmp_path / "pr.diff").write_text(text)
    repo = _tree("0.19.1", [path], tmp_path / "src")
    assert _apply(repo, tmp_path / "pr.diff").returncode == 0
    ours = (repo / path).read_text().splitlines()
    new = tmp_path / "new"
    new.mkdir()
    upstream_path = path.replace("csrc/", "csrc/libtorch_stable/", 1)
    _tree("0.26.0", [upstream_path], new)
    theirs = vllm_prs.rewritten((new / upstream_path).read_text(), entry["rewrite"]).splitlines()
    extra = [line for line in theirs if line not in ours]
    assert extra == ["#include <torch/headeronly/util/shim_utils.h>"], extra
    assert [line for line in ours if line not in theirs] == []
    assert "  bool swap_ab = (M <= 64) || (M % 4 != 0);" in ours  # the dispatch that decode (M = 1..4) takes
