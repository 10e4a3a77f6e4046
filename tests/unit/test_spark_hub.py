"""Unit tests for filter_plugins/spark_hub.py and the drafter revision knobs (issue 15: the DFlash
drafter is served at one commit, resolved once and recorded)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import yaml
from spark_hub import spark_drafter_lock, spark_hub_commit
from spark_methods import spark_method_settings_errors, spark_speculative_config

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_method_catalogue"]
REPO = "z-lab/Qwen3.5-122B-A10B-DFlash"
SHA_A, SHA_B = "a" * 40, "b" * 40


def test_a_commit_knob_is_used_as_is_and_a_branch_reads_the_record():
    fact = {"drafter_revisions": {f"{REPO}@main": SHA_A, f"{REPO}@v2": SHA_B}}
    assert spark_drafter_lock({}, REPO, "c" * 40) == "c" * 40
    assert spark_drafter_lock(fact, REPO, "") == SHA_A          # "" means main
    assert spark_drafter_lock(fact, REPO, "main") == SHA_A
    assert spark_drafter_lock(fact, REPO, "v2") == SHA_B
    assert spark_drafter_lock(fact, "other/repo", "main") == ""  # another repo: resolve
    assert spark_drafter_lock(fact, REPO, "main", update=True) == ""
    assert spark_drafter_lock(fact, REPO, "main", update="false") == SHA_A
    assert spark_drafter_lock({"drafter_revisions": {f"{REPO}@main": "not-a-sha"}}, REPO, "") == ""


class _Hub:
    def __init__(self, status=200, sha=SHA_A):
        self.status, self.sha, self.seen = status, sha, []
        hub = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hub.seen.append((self.path, self.headers.get("Authorization", "")))
                body = json.dumps({"id": REPO, "sha": hub.sha, "siblings": []}).encode()
                self.send_response(hub.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def hub():
    h = _Hub()
    yield h
    h.httpd.shutdown()


def test_a_branch_is_resolved_to_its_commit_with_the_token(hub):
    assert spark_hub_commit(REPO, "", "hf_secret", hub.url) == SHA_A
    path, auth = hub.seen[0]
    assert path.startswith(f"/api/models/{REPO}/revision/main") and auth == "Bearer hf_secret"
    assert spark_hub_commit(REPO, SHA_B, "hf_secret", hub.url) == SHA_B  # a SHA asks nothing
    assert len(hub.seen) == 1


def test_hub_errors_name_the_repo_the_revision_and_the_knob_never_the_token(hub):
    hub.status = 404
    with pytest.raises(ValueError) as err:
        spark_hub_commit(REPO, "main", "hf_secret", hub.url, "spec_dflash_drafter_revision")
    msg = str(err.value)
    assert f"could not resolve the Hub revision {REPO}@main to a commit" in msg
    assert "spec_dflash_drafter_revision to a commit SHA" in msg and "hf_secret" not in msg
    hub.status, hub.sha = 200, "main"
    with pytest.raises(ValueError, match="without a commit SHA"):
        spark_hub_commit(REPO, "main", None, hub.url)


def test_an_unreachable_hub_is_a_clear_error():
    with pytest.raises(ValueError, match=r"could not resolve .*check that the controller reaches http://127.0.0.1:9"):
        spark_hub_commit(REPO, "main", None, "http://127.0.0.1:9")


def _settings(**kw):
    base = {"spec_method": "dflash", "spec_dflash_drafter": REPO, "spec_dflash_drafter_revision": ""}
    base.update(kw)
    return base


APRIL_2026 = "6c7242c934a9870d7c59c05240bdbb2467cc1394"  # z-lab/dflash issue 152: the April weights


def _revision(**kw):
    return spark_speculative_config(_settings(**kw), CATALOGUE).get("revision")


def test_the_catalogue_pins_the_dflash_drafter_to_the_april_commit():
    """issue 44: left at "", the knob serves the commit methods.yml names, not whatever main is."""
    assert CATALOGUE["dflash"]["speculative_config"]["revision"] == APRIL_2026
    assert spark_speculative_config(_settings(), CATALOGUE)["revision"] == APRIL_2026
    assert not spark_method_settings_errors(_settings(), CATALOGUE)
    # the serve role locks it without asking the Hub (a 40-hex SHA is its own lock)
    assert spark_drafter_lock({}, REPO, APRIL_2026) == APRIL_2026
    recorded = {"drafter_revisions": {f"{REPO}@main": SHA_B}}
    assert spark_drafter_lock(recorded, REPO, APRIL_2026, True) == APRIL_2026


def test_the_knob_overrides_the_catalogues_commit():
    assert _revision(spec_dflash_drafter_revision=SHA_A) == SHA_A
    assert not spark_method_settings_errors(_settings(spec_dflash_drafter_revision=SHA_A), CATALOGUE)
    # "main" asks for the branch again: resolved once and recorded, as before the pin
    assert _revision(spec_dflash_drafter_revision="main") == "main"


@pytest.mark.parametrize("drafter", ["/models/dflash", "someone/another-dflash-drafter"])
def test_the_catalogues_commit_does_not_follow_another_drafter(drafter):
    """A commit of z-lab's repo means nothing for a path or another repo: that drafter gets no revision
    (a repo id is then resolved at main and recorded), and a path passes validation."""
    config = spark_speculative_config(_settings(spec_dflash_drafter=drafter), CATALOGUE)
    assert config["model"] == drafter and "revision" not in config
    assert not spark_method_settings_errors(_settings(spec_dflash_drafter=drafter), CATALOGUE)
    assert _revision(spec_dflash_drafter=drafter, spec_dflash_drafter_revision=SHA_B) == SHA_B


def test_the_revision_reaches_the_speculative_config_only_when_set():
    no_pin = {"spec_method": "eagle3", "spec_eagle3_drafter": "org/eagle"}  # the eagle3 entry pins nothing
    assert "revision" not in spark_speculative_config(no_pin, CATALOGUE)
    eagle = {"spec_method": "eagle3", "spec_eagle3_drafter": "org/eagle",
             "spec_eagle3_drafter_revision": "v1"}
    assert spark_speculative_config(eagle, CATALOGUE)["revision"] == "v1"


@pytest.mark.parametrize(("value", "needle"), [
    (5, "must be a string"),
    ("has space", "is not a Hub revision"),
    ("-rf", "is not a Hub revision"),
    ("a..b", "is not a Hub revision"),
])
def test_bad_revisions_are_refused_naming_the_knob(value, needle):
    errors = spark_method_settings_errors(_settings(spec_dflash_drafter_revision=value), CATALOGUE)
    assert any(e.startswith("spec_dflash_drafter_revision=") and needle in e for e in errors), errors


def test_a_revision_for_a_drafter_path_is_refused():
    errors = spark_method_settings_errors(
        _settings(spec_dflash_drafter="/models/dflash", spec_dflash_drafter_revision="main"), CATALOGUE)
    assert any("applies to a Hub repo id" in e for e in errors), errors
    assert not spark_method_settings_errors(_settings(spec_dflash_drafter_revision="refs/pr/3"), CATALOGUE)
