"""fetch-prompts: sha256 verified download + conversion; mismatch and unpinned refused."""

from __future__ import annotations

import hashlib
import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import bench
import pytest
from sparkllm.bench import common as bench_common
from sparkllm.bench import prompts as bench_prompts

LINES = [
    {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it."]},
    {"question_id": 2001, "category": "translation", "turns": ["Translate: bonjour"]},
]


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, str]:
    f = tmp_path / "question.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in LINES) + "\n")
    return f, hashlib.sha256(f.read_bytes()).hexdigest()


def manifest(sha: str) -> dict[str, str]:
    return {"name": "Spec-Bench", "commit": "0" * 40, "sha256": sha,
            "url_template": "https://example.invalid/{commit}/question.jsonl"}


def test_file_url_verified_and_converted(tmp_path: Path, source: tuple[Path, str]) -> None:
    f, sha = source
    dest = tmp_path / "out" / "specbench.jsonl"
    assert bench_prompts.fetch_prompts(manifest(sha), dest, url=f.as_uri()) == 2
    rows = [json.loads(x) for x in dest.read_text().splitlines()]
    assert rows[0] == {"id": "specbench-81", "category": "writing",
                       "messages": [{"role": "user", "content": "Write a travel blog post."}]}
    prompts, _ = bench_prompts.load_prompts(dest)
    assert [p.category for p in prompts] == ["writing", "translation"]


def test_http_download(tmp_path: Path, source: tuple[Path, str]) -> None:
    f, sha = source
    handler = partial(SimpleHTTPRequestHandler, directory=str(f.parent))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/question.jsonl"
        dest = tmp_path / "sb.jsonl"
        rc = bench.main(["fetch-prompts", "--source", "specbench", "--dest", str(dest), "--url", url,
                         "--sha256", sha, "--manifest", str(_write_manifest(tmp_path, "TO-BE-FILLED"))])
        assert rc == 0 and len(dest.read_text().splitlines()) == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


def _write_manifest(tmp_path: Path, sha: str) -> Path:
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(manifest(sha)))
    return p


def test_checksum_mismatch_refused(tmp_path: Path, source: tuple[Path, str]) -> None:
    f, _ = source
    dest = tmp_path / "sb.jsonl"
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        bench_prompts.fetch_prompts(manifest("ab" * 32), dest, url=f.as_uri())
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".download")] == []


def test_unpinned_refused_unless_allowed(tmp_path: Path, source: tuple[Path, str]) -> None:
    f, _ = source
    with pytest.raises(SystemExit, match="not pinned"):
        bench_prompts.fetch_prompts(manifest("TO-BE-FILLED"), tmp_path / "a.jsonl", url=f.as_uri())
    assert bench_prompts.fetch_prompts(manifest("TO-BE-FILLED"), tmp_path / "a.jsonl", url=f.as_uri(),
                               allow_unpinned=True) == 2


SPECBENCH_COMMIT = "fd2c1cd7d2201ef71db4c5f4e455008f017967bf"
SPECBENCH_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"


def test_shipped_manifest_is_pinned() -> None:
    m = json.loads(bench_common.SPECBENCH_MANIFEST.read_text())
    assert m["commit"] == SPECBENCH_COMMIT and m["sha256"] == SPECBENCH_SHA256 and m["lines"] == 480
    url = m["url_template"].format(commit=m["commit"])
    assert url == ("https://raw.githubusercontent.com/hemingkx/Spec-Bench/"
                   f"{SPECBENCH_COMMIT}/data/spec_bench/question.jsonl")


def test_pinned_manifest_verifies_the_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped manifest, with the download replaced by a local fake: the sha256 decides."""
    m = json.loads(bench_common.SPECBENCH_MANIFEST.read_text())
    seen: list[str] = []
    fake = tmp_path / "fake.jsonl"
    fake.write_text("\n".join(json.dumps(x) for x in LINES) + "\n")

    def urlopen(url: str, timeout: float = 0):  # noqa: ARG001 - same signature as urllib's
        seen.append(url)
        return fake.open("rb")

    monkeypatch.setattr(bench_prompts.urllib.request, "urlopen", urlopen)
    dest = tmp_path / "sb.jsonl"
    rc = bench.main(["fetch-prompts", "--source", "specbench", "--dest", str(dest)])
    assert rc == 1 and not dest.exists()  # the fake's sha256 is not the pinned one
    assert seen == [m["url_template"].format(commit=SPECBENCH_COMMIT)]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".download")] == []
    # the same check passes for a file whose sha256 matches the pin (here: the fake, pinned by hand)
    sha = hashlib.sha256(fake.read_bytes()).hexdigest()
    pinned = {**m, "sha256": sha, "lines": 2}
    assert bench_prompts.fetch_prompts(pinned, dest) == 2
    # ...and a pinned line count that disagrees is refused too
    with pytest.raises(SystemExit, match="the pinned file has 3"):
        bench_prompts.fetch_prompts({**pinned, "lines": 3}, tmp_path / "other.jsonl")


def test_shipped_prompt_set() -> None:
    prompts, sha = bench_prompts.load_prompts(bench_common.DEFAULT_PROMPTS)
    cats: dict[str, int] = {}
    for p in prompts:
        cats[p.category] = cats.get(p.category, 0) + 1
    assert set(cats) == {"chat_qa", "code", "json", "math", "long_code", "summarisation", "translation",
                         "multi_turn"}
    assert min(cats.values()) >= 4 and len({p.id for p in prompts}) == len(prompts)
    assert any(len(p.messages) > 1 for p in prompts if p.category == "multi_turn")
    assert len(sha) == 64
