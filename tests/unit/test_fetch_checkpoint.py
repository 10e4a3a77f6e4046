"""fetch_checkpoint.py: range fetch against the local Range server, mirror, hub verification, disk, token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import fetch_checkpoint as fc
import hybrid_merge
import pytest
from sparkllm.checkpoint import hybrid as ck
from sparkllm.checkpoint.safetensors_io import INDEX_NAME, read_header, read_index, read_tensor_bytes
from sparkllm.fileio import sha256_file

from tests.fixtures.make_checkpoints import GenConfig, GeneratedPair, generate
from tests.fixtures.range_server import RangeServer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_checkpoint.py"
REPO = "Qwen/Qwen3.5-122B-A10B-FP8"
SECRET = "hf_SuperSecretToken0123456789"
CFG = GenConfig(layers=4, experts=4)


@pytest.fixture
def pair(tmp_path: Path) -> GeneratedPair:
    return generate(tmp_path / "src", CFG)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full_env)


def extract(srv: RangeServer, dest: Path, *extra: str, env: dict[str, str] | None = None):
    return run(
        "fp8-extract", "--repo", REPO, "--revision", "main", "--dest", str(dest), "--endpoint", srv.endpoint,
        "--retry-backoff-s", "0", *extra, env=env,
    )  # fmt: skip



def test_fp8_extract_transfers_only_needed_bytes(pair: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "ext" / "fp8-shared-expert.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        r = extract(srv, dest)
        assert r.returncode == 0, r.stderr
        sent = srv.state.bytes_sent
    idx = read_index(pair.fp8_dir / INDEX_NAME)
    shards = sorted(set(idx.files))
    out = read_header(dest)
    expected_names = set(pair.expected_taken) | {ck.scale_name(n) for n in pair.expected_taken}
    assert set(out.tensors) == expected_names
    for name in expected_names:
        src = pair.fp8_dir / idx.weight_map[name]
        assert read_tensor_bytes(dest, name) == read_tensor_bytes(src, name)
        assert out.tensors[name].shape == read_header(src).tensors[name].shape
    headers = sum(read_header(pair.fp8_dir / f).data_start for f in shards)
    index_bytes = (pair.fp8_dir / INDEX_NAME).stat().st_size
    assert sent == index_bytes + headers + out.data_size
    full_size = sum((pair.fp8_dir / f).stat().st_size for f in shards)
    assert out.data_size < full_size / 10
    record = json.loads((dest.parent / ".sparkllm_source.json").read_text())
    assert record["repo"] == REPO and record["commit"] == "c0ffee" * 6 + "c0ff" and record["tensors"] == 24
    assert read_index(dest.parent / INDEX_NAME).total_size == out.data_size


def test_fp8_extract_rerun_is_noop(pair: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "ext" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        assert extract(srv, dest).returncode == 0
        n = len(srv.state.requests)
        r = extract(srv, dest)
        assert r.returncode == 0 and json.loads(r.stdout)["changed"] is False
        assert len(srv.state.requests) == n


def test_merge_with_extract_equals_merge_with_full(pair: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "ext" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        assert extract(srv, dest).returncode == 0
    a, b = tmp_path / "a", tmp_path / "b"
    assert hybrid_merge.main(["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir), "--out", str(a)]) == 0
    assert hybrid_merge.main(["--int4", str(pair.int4_dir), "--fp8", str(dest.parent), "--out", str(b)]) == 0
    for f in a.glob("*.safetensors"):
        assert f.read_bytes() == (b / f.name).read_bytes()
    cfg_b = json.loads((b / "config.json").read_text())
    assert cfg_b["sparkllm_provenance"]["fp8"]["repo"] == REPO


BAD_RANGES = [
    ("short", "short body"),
    ("wrong", "wrong Content-Range"),
    ("ignore", "expected HTTP 206"),
]


@pytest.mark.parametrize(("mode", "message"), BAD_RANGES)
def test_bad_ranges_are_caught(pair: GeneratedPair, tmp_path: Path, mode: str, message: str) -> None:
    dest = tmp_path / "ext" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO, mode=mode) as srv:
        r = extract(srv, dest)
    assert r.returncode == 1
    assert message in r.stderr and "model-0000" in r.stderr
    assert not dest.exists() and not list(dest.parent.glob(".*incomplete*"))


def test_missing_repo_and_no_match(pair: GeneratedPair, tmp_path: Path) -> None:
    with RangeServer(pair.fp8_dir, repo="other/repo") as srv:
        r = extract(srv, tmp_path / "ext" / "x.safetensors")
    assert r.returncode == 1 and "HTTP 404" in r.stderr
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        r = extract(srv, tmp_path / "ext" / "x.safetensors", "--pattern", "nothing_matches_this")
    assert r.returncode == 1 and "no FP8 tensors" in r.stderr


def test_token_sent_but_never_leaked(pair: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "ext" / "x.safetensors"
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        r1 = extract(srv, dest, env={"HF_TOKEN": SECRET})
        dest.unlink()
        r2 = extract(srv, dest, "--token-file", str(token_file))
        with RangeServer(pair.fp8_dir, repo=REPO, mode="short") as bad:
            r3 = extract(bad, tmp_path / "y" / "y.safetensors", env={"HF_TOKEN": SECRET})
        auths = srv.state.auth_headers
    assert r1.returncode == 0 and r2.returncode == 0 and r3.returncode == 1
    assert auths and all(a == f"Bearer {SECRET}" for a in auths)
    for r in (r1, r2, r3):
        assert SECRET not in r.stdout and SECRET not in r.stderr
    for f in dest.parent.rglob("*"):
        assert SECRET.encode() not in f.read_bytes()


def test_disk_space_refusal(pair: GeneratedPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**12, 10**12, 1000))
    with pytest.raises(fc.FetchError) as exc:
        fc.check_disk_space(tmp_path / "not" / "yet", 5 * 2**30)
    msg = str(exc.value)
    assert "not enough disk space" in msg and "6.10 GiB" in msg and "0.00 GiB free" in msg and "--dest" in msg
    src = tmp_path / "mirror"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 10)
    fc.write_manifest(src, True)
    with pytest.raises(fc.FetchError, match="not enough disk space"):
        fc.mirror_fetch(src, tmp_path / "dest")
    assert not (tmp_path / "dest" / "a.bin").exists()


# ------------------------------------------------------------------ mirror


def test_mirror_copy_verified_and_rerun_noop(pair: GeneratedPair, tmp_path: Path) -> None:
    r = run("manifest", str(pair.int4_dir))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((pair.int4_dir / ck.MANIFEST_NAME).read_text())
    names = {f["name"] for f in manifest["files"]}
    assert "model_extra_tensors.safetensors" in names and all(
        len(f["sha256"]) == 64 for f in manifest["files"]
    )
    dest = tmp_path / "int4-copy"
    r = run("mirror", "--src", str(pair.int4_dir), "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["copied"] == len(names)
    for n in names:
        assert (dest / n).read_bytes() == (pair.int4_dir / n).read_bytes()
    assert ck.verify_checkpoint(dest).problems == [
        f"{dest / ck.EXTRA_FILE}: present but not listed in {INDEX_NAME}"
    ]  # the INT4 index does not list MTP names: that is what mtp_index_patch repairs
    r = run("mirror", "--src", str(pair.int4_dir), "--dest", str(dest))
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] is False


def test_corrupt_mirror_file_caught(pair: GeneratedPair, tmp_path: Path) -> None:
    assert run("manifest", str(pair.int4_dir)).returncode == 0
    shard = pair.int4_dir / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    dest = tmp_path / "copy"
    r = run("mirror", "--src", str(pair.int4_dir), "--dest", str(dest))
    assert r.returncode == 1
    assert str(shard) in r.stderr and "sha256" in r.stderr
    assert not (dest / shard.name).exists() and not list(dest.glob(".*incomplete*"))


def test_mirror_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "mirror").mkdir()
    r = run("mirror", "--src", str(tmp_path / "mirror"), "--dest", str(tmp_path / "d"))
    assert r.returncode == 2 and "manifest missing" in r.stderr and "fetch_checkpoint.py manifest" in r.stderr
    assert not (tmp_path / "d").exists()  # a usage error creates nothing


# ------------------------------------------------------------------ hub mode (fake client)


class FakeHub:
    def __init__(self, src: Path, corrupt: str | None = None) -> None:
        self.src = src
        self.corrupt = corrupt
        self.downloads: list[str] = []

    def list_files(self) -> list[fc.RemoteFile]:
        out = []
        for p in sorted(self.src.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                lfs = p.suffix == ".safetensors"
                out.append(
                    fc.RemoteFile(
                        p.name, p.stat().st_size, sha256_file(p) if lfs else None, fc.git_blob_sha1(p)
                    )
                )
        return out

    def download(self, name: str, dest_dir: Path) -> Path:
        self.downloads.append(name)
        data = (self.src / name).read_bytes()
        if name == self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 1])
        (dest_dir / name).write_bytes(data)
        return dest_dir / name

    def commit(self) -> str | None:
        return "abc123"


def test_hub_fetch_verifies_and_resumes(pair: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "hub"
    hub = FakeHub(pair.int4_dir, corrupt="model-00001-of-00003.safetensors")
    with pytest.raises(fc.FetchError, match="sha256 differs"):
        fc.hub_fetch(hub, "Intel/x", "rev1", dest, ["*.safetensors"])
    assert not (dest / "model-00001-of-00003.safetensors").exists()
    hub.corrupt = "config.json"
    with pytest.raises(fc.FetchError, match="git blob id differs"):
        fc.hub_fetch(hub, "Intel/x", "rev1", dest, [])
    hub.corrupt = None
    hub.downloads.clear()
    res = fc.hub_fetch(hub, "Intel/x", "rev1", dest, [])
    assert res["changed"] is True and res["commit"] == "abc123"
    assert "model-00001-of-00003.safetensors" in hub.downloads
    hub.downloads.clear()
    res = fc.hub_fetch(hub, "Intel/x", "rev1", dest, [])
    assert res["changed"] is False and hub.downloads == []
    assert json.loads((dest / ".sparkllm_source.json").read_text())["commit"] == "abc123"


def test_hub_rerun_at_the_locked_commit_reuses_files_fetched_from_the_branch(
    pair: GeneratedPair, tmp_path: Path
) -> None:
    """The role reruns a fetch with the commit SHA recorded at the first fetch (which named a branch):
    files verified then are not downloaded again; another commit starts over."""
    dest = tmp_path / "hub"
    hub = FakeHub(pair.int4_dir)
    assert fc.hub_fetch(hub, "Intel/x", "main", dest, [])["changed"] is True
    (dest / "config.json").unlink()  # one file lost: the role's todo check sends this checkpoint again
    hub.downloads.clear()
    res = fc.hub_fetch(hub, "Intel/x", "abc123", dest, [])
    assert hub.downloads == ["config.json"] and res["commit"] == "abc123"
    record = json.loads((dest / ".sparkllm_source.json").read_text())
    assert record["revision"] == "abc123" and record["commit"] == "abc123"
    hub.commit = lambda: "def456"  # type: ignore[method-assign]
    hub.downloads.clear()
    fc.hub_fetch(hub, "Intel/x", "main", dest, [])
    assert "config.json" in hub.downloads and len(hub.downloads) > 1


def test_hub_include_filter_and_no_match(pair: GeneratedPair, tmp_path: Path) -> None:
    hub = FakeHub(pair.int4_dir)
    fc.hub_fetch(hub, "Intel/x", "r", tmp_path / "d", ["*.json"])
    assert hub.downloads and all(n.endswith(".json") for n in hub.downloads)
    with pytest.raises(fc.FetchError, match="no files match"):
        fc.hub_fetch(hub, "Intel/x", "r", tmp_path / "d", ["*.gguf"])


def test_token_file_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "t"
    empty.write_text("\n")
    with pytest.raises(fc.UsageError, match="--token-file is empty"):
        fc.read_token(empty)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert fc.read_token(None) == SECRET
    monkeypatch.delenv("HF_TOKEN")
    assert fc.read_token(None) is None


def test_usage_and_help() -> None:
    r = run()
    assert r.returncode == 2
    r = run("--help")
    for word in ("fp8-extract", "mirror", "manifest", "full", "hub", "HF_TOKEN", "Exit codes"):
        assert word in r.stdout


def test_extract_of_extract_config(tmp_path: Path) -> None:
    """A generated extract-mode pair already holds exactly what fp8-extract would fetch."""
    pair = generate(tmp_path / "e", replace(CFG, fp8_mode="extract"))
    names = set(read_header(pair.fp8_dir / "fp8-extract.safetensors").tensors)
    assert set(pair.expected_taken) <= names


def test_hf_hub_client_maps_hub_metadata(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    calls: dict[str, object] = {}

    class FakeApi:
        def __init__(self, endpoint: str, token: str | None) -> None:
            calls["api"] = (endpoint, token)

        def model_info(self, repo: str, revision: str):
            calls.setdefault("model_info", []).append(revision)
            return type("Info", (), {"sha": "9" * 40})()

        def list_repo_files(self, repo: str, revision: str) -> list[str]:
            assert revision == "9" * 40  # pinned before the first listing
            return ["a.safetensors", "config.json", "sub"]

        def get_paths_info(self, repo: str, paths: list[str], revision: str, expand: bool) -> list:
            return [
                RepoFile(
                    path="a.safetensors",
                    size=10,
                    oid="b1",
                    lfs={"oid": "f" * 64, "size": 10, "pointerSize": 1},
                ),
                RepoFile(path="config.json", size=3, oid="c" * 40),
                RepoFolder(path="sub", oid="d"),
            ]

    def fake_download(repo, name, revision, local_dir, token, endpoint) -> str:
        calls["download"] = (repo, name, revision, token, endpoint)
        return str(Path(local_dir) / name)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    client = fc.HfHubClient("o/r", "rev", "http://hub", SECRET)
    files = client.list_files()
    assert files == [
        fc.RemoteFile("a.safetensors", 10, "f" * 64, "b1"),
        fc.RemoteFile("config.json", 3, None, "c" * 40),
    ]
    assert client.download("a.safetensors", tmp_path) == tmp_path / "a.safetensors"
    assert calls["download"] == ("o/r", "a.safetensors", "9" * 40, SECRET, "http://hub")
    assert client.commit() == "9" * 40 and calls["model_info"] == ["rev"]  # resolved once


def test_fp8_extract_as_the_hub_serves_it(pair: GeneratedPair, tmp_path: Path) -> None:
    """Redirects to a content server, 503s and connections cut mid-body: the bytes still match a
    clean fetch, the token never reaches the content server, and the retries are counted."""
    clean = tmp_path / "clean" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        assert extract(srv, clean).returncode == 0
    dest = tmp_path / "rough" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO, redirect=True, fail_first=3, drop_first=2) as srv:
        r = extract(srv, dest, env={"HF_TOKEN": SECRET})
        st = srv.state
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == clean.read_bytes()
    assert st.failures_sent == 3 and st.drops_sent == 2
    assert r.stderr.count("transient:") == 5
    assert st.cdn_auth_headers and not any(st.cdn_auth_headers)  # token stays with the Hub
    assert all(a == f"Bearer {SECRET}" for a in st.auth_headers)
    shards = [rng for path, rng in st.requests if path.startswith("/cdn/") and ".safetensors?" in path]
    assert shards and all(rng is not None for rng in shards)  # Range kept across the redirect
    assert SECRET not in r.stderr + r.stdout


def test_fp8_extract_gives_up_after_its_retries(pair: GeneratedPair, tmp_path: Path) -> None:
    dest = tmp_path / "ext" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO, fail_first=100) as srv:
        r = extract(srv, dest, "--retries", "2")
        sent = srv.state.failures_sent
    assert r.returncode == 1 and "HTTP 503" in r.stderr and "gave up after 3 attempts" in r.stderr
    assert sent == 3
    assert not dest.exists()


def test_fp8_extract_reads_one_commit_even_if_the_branch_moves(pair: GeneratedPair, tmp_path: Path) -> None:
    """The first answer names the commit; every later request asks for that commit by name, so a
    push to the branch during the fetch cannot mix two commits."""
    dest = tmp_path / "ext" / "x.safetensors"
    with RangeServer(pair.fp8_dir, repo=REPO) as srv:
        r = extract(srv, dest)
        paths = [p for p, _ in srv.state.requests]
        commit = srv.state.commit
    assert r.returncode == 0, r.stderr
    assert "/resolve/main/" in paths[0]
    assert all(f"/resolve/{commit}/" in p for p in paths[1:]) and len(paths) > 2
    record = json.loads((dest.parent / ".sparkllm_source.json").read_text())
    assert record["revision"] == "main" and record["commit"] == commit
