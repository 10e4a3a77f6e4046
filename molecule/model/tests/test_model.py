"""Behaviour of the model stage on the systemd test host: mirror fetch -> hybrid merge -> MTP patch -> verify.

The expected tensor counts come from the same generator prepare.yml used (tests/fixtures/make_checkpoints.py,
default tiny config, FP8 in extract mode). Paths match molecule/model/host_vars/spark-model.yml.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from playbook_runner import run_playbook

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT / "tests" / "fixtures"))
import make_checkpoints as gen  # noqa: E402

MODEL = "/srv/models/qwen3.5-122b-hybrid"
MIRROR = "/srv/mirror/qwen3.5-122b"
INT4 = "/srv/models/src/qwen3.5-122b-a10b-int4-autoround"
FP8 = "/srv/models/src/qwen3.5-122b-a10b-fp8-extract"
TOOLS = "/opt/sparkllm/scripts"
FACT = "/etc/ansible/facts.d/spark_model.fact"
EXTRA = "model_extra_tensors.safetensors"
CFG = gen.GenConfig(fp8_mode="extract")
MTP_NAMES = {t.name for t in gen.mtp_tensors(CFG, gen.bf16)}
TAKEN = gen.expected_taken(CFG)
# Work area for negative runs: their own checkpoint dirs and fact dir, the real merged model as the target.
NEG = {
    "model_fetch_int4_dir": "/srv/neg/int4",
    "model_fetch_fp8_dir": "/srv/neg/fp8",
    "model_fetch_facts_dir": "/srv/neg/facts",
    "model_fetch_poll_seconds": 2,
    "model_hybrid_poll_seconds": 2,
}

HEADER_DUMP = (
    "import json,struct,sys,pathlib\n"
    "out={}\n"
    "for p in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors')):\n"
    "    b=p.open('rb'); n=struct.unpack('<Q',b.read(8))[0]; h=json.loads(b.read(n))\n"
    "    h.pop('__metadata__',None); out[p.name]={k:v['dtype'] for k,v in h.items()}\n"
    "print(json.dumps(out))\n"
)


def _json(host, path):
    return json.loads(host.file(path).content_string)


def _dtypes(host, directory):
    res = host.run("python3 -c %s %s", HEADER_DUMP, directory)
    assert res.rc == 0, res.stderr
    return json.loads(res.stdout)


def _recap_changed(output: str) -> int:
    recap = output.split("PLAY RECAP")[-1]
    return int(recap.split("changed=")[1].split()[0])


def _snapshot(host):
    """Inode and mtime of the merged model dir, sha256 of its index and of the fact: one command."""
    return host.check_output(
        "stat -c '%%i %%Y' %s %s && sha256sum %s %s",
        MODEL,
        f"{INT4}/{EXTRA}",
        f"{MODEL}/model.safetensors.index.json",
        FACT,
    )


def _sha256s(host, directory):
    return dict(
        reversed(line.split("  ", 1))
        for line in host.check_output(
            "cd %s && find . -type f -printf '%%P\\0' | xargs -0 sha256sum", directory
        ).splitlines()
    )


def _flat(text):
    return " ".join(text.split())


def test_merged_model_passes_the_verifier_on_the_host(host):
    res = host.run(f"python3 {TOOLS}/verify_checkpoint.py {MODEL} --expect-mtp --expect-hybrid --json")
    assert res.rc == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] is True
    assert report["mtp_tensors"] == len(MTP_NAMES)
    assert report["fp8_weights"] == len(TAKEN)
    assert report["block_size"] == CFG.block


def test_index_registers_every_mtp_tensor_from_the_extra_file(host):
    wm = _json(host, f"{MODEL}/model.safetensors.index.json")["weight_map"]
    mtp = {name: f for name, f in wm.items() if name.startswith("mtp.")}
    assert set(mtp) == MTP_NAMES
    assert set(mtp.values()) == {EXTRA}
    assert host.file(f"{MODEL}/{EXTRA}").is_file


def test_shared_experts_are_fp8_with_scales_and_experts_stay_int4(host):
    wm = _json(host, f"{MODEL}/model.safetensors.index.json")["weight_map"]
    dtypes = {name: dt for shard in _dtypes(host, MODEL).values() for name, dt in shard.items()}
    assert set(dtypes) == set(wm)  # index and files agree both ways
    fp8 = sorted(n for n, dt in dtypes.items() if dt == "F8_E4M3")
    assert fp8 == sorted(TAKEN)
    scales = sorted(n for n in wm if n.endswith(".weight_scale_inv"))
    assert scales == sorted(n.removesuffix(".weight") + ".weight_scale_inv" for n in TAKEN)
    for name in TAKEN:
        assert wm[name] == wm[name.removesuffix(".weight") + ".weight_scale_inv"]
    assert not [n for n in fp8 if ".experts." in n]
    # the same-name, different-shape decoy in the FP8 extract is not taken
    assert dtypes["model.language_model.layers.0.mlp.shared_expert_gate.weight"] == "BF16"


def test_merged_files_open_with_the_safetensors_library(host, tmp_path):
    safetensors = pytest.importorskip("safetensors")
    wm = _json(host, f"{MODEL}/model.safetensors.index.json")["weight_map"]
    names: set[str] = set()
    for fname in sorted(set(wm.values())):
        local = tmp_path / fname
        local.write_bytes(host.file(f"{MODEL}/{fname}").content)
        with safetensors.safe_open(str(local), framework="numpy") as f:
            names.update(f.keys())
    assert names == set(wm)


def test_fact_records_inputs_and_output_manifests(host):
    fact = _json(host, FACT)
    assert fact["int4_verified"] and fact["fp8_verified"] and fact["hybrid_verified"]
    assert fact["int4"]["dir"] == INT4 and fact["fp8"]["dir"] == FP8
    assert fact["int4"]["manifest_sha256"] == host.file(f"{INT4}/sparkllm-manifest.json").sha256sum
    assert fact["fp8"]["manifest_sha256"] == host.file(f"{FP8}/sparkllm-manifest.json").sha256sum
    assert fact["int4"]["source"].startswith(f"mirror:{MIRROR}/int4#")
    hybrid = fact["hybrid"]
    assert hybrid["dir"] == MODEL
    assert hybrid["manifest_sha256"] == host.file(f"{MODEL}/sparkllm-manifest.json").sha256sum
    inputs = {"int4": fact["int4"]["manifest_sha256"], "fp8": fact["fp8"]["manifest_sha256"]}
    assert hybrid["inputs"] == inputs
    assert hybrid["summary"]["taken_from_fp8"] == len(TAKEN)
    assert hybrid["summary"]["mtp_registered"] == len(MTP_NAMES)
    assert host.file(FACT).mode == 0o644


def test_fetched_checkpoints_match_the_mirror_byte_for_byte(host):
    for key, dest in (("int4", INT4), ("fp8", FP8)):
        got = _sha256s(host, dest)
        for entry in _json(host, f"{MIRROR}/{key}/sparkllm-manifest.json")["files"]:
            if entry["name"] == ".sparkllm_source.json":
                continue  # rewritten by the fetch to record the mirror it came from
            assert got[entry["name"]] == entry["sha256"], entry["name"]


def test_no_staging_or_old_directories_are_left(host):
    assert not host.file(f"{MODEL}.staging").exists
    assert not host.file(f"{MODEL}.old").exists
    assert not host.run(f"ls -d {MODEL}.staging.tmp-* 2>/dev/null").stdout.strip()


def test_rerun_ends_at_the_stage_gate_and_touches_nothing(host):
    """issue 14: unchanged inputs and checkpoint directories end the stage before its roles run."""
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml")
    assert res.rc == 0, res.output[-3000:]
    assert _recap_changed(res.output) == 0
    assert "model stage ends here" in _flat(res.output)
    assert "TASK [model_fetch :" not in res.output and "TASK [model_hybrid :" not in res.output
    assert _snapshot(host) == before


def test_forced_rerun_runs_no_tool_and_touches_nothing(host):
    """Past the gate the roles' own records still skip every tool."""
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml", {"spark_stage_force": True})
    assert res.rc == 0, res.output[-3000:]
    assert _recap_changed(res.output) == 0
    assert "TASK [model_fetch : Start fetching" not in res.output
    assert "TASK [model_hybrid : Start the merge" not in res.output
    assert "TASK [model_hybrid : Verify the merged checkpoint" not in res.output
    assert "nothing fetched" in _flat(res.output) and "nothing merged" in _flat(res.output)
    assert _snapshot(host) == before


def test_check_mode_on_a_converged_host_reports_no_change(host):
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml", extra_args=["--check", "--diff"])
    assert res.rc == 0, res.output[-3000:]
    assert _recap_changed(res.output) == 0
    assert _snapshot(host) == before


def test_force_check_mode_prints_the_merge_plan_without_writing(host):
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml", {"model_hybrid_force": True}, extra_args=["--check"])
    assert res.rc == 0, res.output[-3000:]
    out = _flat(res.output)
    assert f"Merge plan: {len(TAKEN)} weights (+ {len(TAKEN)} scales) from FP8" in out
    assert f"{len(MTP_NAMES)} mtp.* tensors registered" in out
    assert "shape mismatch x1" in out
    assert _snapshot(host) == before
    assert not host.file(f"{MODEL}.staging").exists


PROBE = "sparkllm-vllm-probe"  # a stand-in server unit (model_hybrid_server_unit_prefix-*)
PROBE_UNIT = f"""[Unit]
Description=stand-in server that holds the merged model open
[Service]
ExecStart=/bin/sh -c 'cd {MODEL} && exec sleep infinity'
ExecStop=/bin/sh -c 'stat -c %%i {MODEL} > /tmp/{PROBE}-saw'
"""


@pytest.fixture
def probe_server(host):
    host.check_output(f"cat > /etc/systemd/system/{PROBE}.service <<'EOF'\n{PROBE_UNIT}EOF\n")
    host.check_output(f"rm -f /tmp/{PROBE}-saw && systemctl daemon-reload && systemctl start {PROBE}")
    yield
    host.run(f"systemctl stop {PROBE}; rm -f /etc/systemd/system/{PROBE}.service /tmp/{PROBE}-saw; "
             "systemctl daemon-reload")


def test_a_new_merge_stops_the_server_before_it_replaces_the_model(host, probe_server):
    """A running server holds the model directory: the model stage stops it before the swap, so it
    never serves a directory that was moved and deleted under it."""
    assert host.service(f"{PROBE}.service").is_running
    old_inode = host.check_output("stat -c %%i %s", MODEL)
    res = run_playbook("playbooks/model.yml", {"model_hybrid_force": True})
    assert res.rc == 0, res.output[-3000:]
    assert f"Stopped {PROBE}.service before replacing {MODEL}" in _flat(res.output)
    assert not host.service(f"{PROBE}.service").is_running
    # when the unit stopped, the model it held was still the old directory, in place
    assert host.file(f"/tmp/{PROBE}-saw").content_string.strip() == old_inode
    assert host.check_output("stat -c %%i %s", MODEL) != old_inode  # then the new one moved in
    fact = _json(host, FACT)
    assert fact["hybrid_verified"] and fact["int4_verified"] and fact["fp8_verified"]
    assert fact["hybrid"]["manifest_sha256"] == host.file(f"{MODEL}/sparkllm-manifest.json").sha256sum
    assert not host.file(f"{MODEL}.old").exists and not host.file(f"{MODEL}.staging").exists


@pytest.fixture
def neg_area(host):
    host.run("rm -rf /srv/neg /srv/mirror-bad")
    yield
    host.run("rm -rf /srv/neg /srv/mirror-bad")


def test_corrupt_mirror_file_fails_naming_it_and_keeps_the_model(host, neg_area):
    shard = "model-00002-of-00003.safetensors"
    prep = host.run(f"cp -a {MIRROR} /srv/mirror-bad && truncate -s -100 /srv/mirror-bad/int4/{shard}")
    assert prep.rc == 0, prep.stderr
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml", {**NEG, "model_fetch_mirror_dir": "/srv/mirror-bad"})
    assert res.rc != 0
    assert f"/srv/mirror-bad/int4/{shard}" in _flat(res.output)
    assert "corrupt" in res.output
    assert "TASK [model_hybrid" not in res.output
    assert _snapshot(host) == before
    assert not host.file(f"/srv/neg/int4/{shard}").exists  # nothing half-written under the final name
    assert _json(host, "/srv/neg/facts/spark_model.fact")["int4_verified"] is False


def test_missing_mtp_extra_file_fails_clearly_and_keeps_the_model(host, neg_area):
    prep = host.run(
        f"cp -a {MIRROR} /srv/mirror-bad && rm /srv/mirror-bad/int4/{EXTRA} && "
        f"python3 {TOOLS}/fetch_checkpoint.py manifest /srv/mirror-bad/int4"
    )
    assert prep.rc == 0, prep.stderr
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml", {**NEG, "model_fetch_mirror_dir": "/srv/mirror-bad"})
    assert res.rc != 0
    assert f"/srv/neg/int4/{EXTRA} is missing" in _flat(res.output)
    assert "MTP" in res.output
    assert _snapshot(host) == before
    assert not host.file(f"{MODEL}.staging").exists


def test_too_little_disk_fails_before_anything_is_copied(host, neg_area):
    before = _snapshot(host)
    res = run_playbook("playbooks/model.yml", {**NEG, "model_fetch_disk_margin_bytes": 10**18})
    assert res.rc != 0
    assert "Not enough disk for the model stage, nothing was fetched" in _flat(res.output)
    assert "GB needed" in _flat(res.output) and "spark_model_root" in _flat(res.output)
    assert not host.file("/srv/neg/int4").exists
    assert not host.file("/srv/neg/fp8").exists
    assert _snapshot(host) == before


def test_missing_mirror_manifest_names_the_fix(host, neg_area):
    host.run(f"cp -a {MIRROR} /srv/mirror-bad && rm /srv/mirror-bad/fp8/sparkllm-manifest.json")
    res = run_playbook("playbooks/model.yml", {**NEG, "model_fetch_mirror_dir": "/srv/mirror-bad"})
    assert res.rc != 0
    assert "/srv/mirror-bad/fp8/sparkllm-manifest.json cannot be read" in _flat(res.output)
    assert "fetch_checkpoint.py manifest" in _flat(res.output)
    assert not host.file("/srv/neg/int4").exists


def test_a_rerun_during_the_background_download_attaches_to_it(host, neg_area):
    """model-start.yml (site.yml runs it before the build) leaves the download running; the model stage
    run meanwhile follows that job instead of starting a second one, and the INT4 shards were merged
    while the rest was still arriving."""
    extra = {**NEG, "spark_model_dir": "/srv/neg/model", "model_fetch_job_dir": "/srv/neg/job",
             "model_fetch_log": "/srv/neg/model-fetch.log", "model_fetch_mirror_max_rate": 12000}  # ~1 min
    res = run_playbook("playbooks/model-start.yml", extra)
    assert res.rc == 0, res.output[-3000:]
    assert "Downloading INT4 and FP8 in the background" in _flat(res.output)
    assert _json(host, "/srv/neg/job/status.json")["state"] == "running"
    assert host.file("/srv/neg/job/job.json").mode == 0o600
    res = run_playbook("playbooks/model.yml", extra)
    assert res.rc == 0, res.output[-3000:]
    # still running, or (on a loaded machine) ended since, not yet collected: followed either way
    assert "following it instead of starting another" in _flat(res.output)
    log = host.file("/srv/neg/model-fetch.log").content_string
    assert log.count("started the INT4 fetch") == 1, log
    status = _json(host, "/srv/neg/job/status.json")
    assert status["state"] == "done"
    assert min(status["merged"].values()) < status["fetches"]["int4"]["ended"] - 5, status
    assert not host.file("/srv/neg/job/job.json").exists  # released by the run that collected it
    fact = _json(host, "/srv/neg/facts/spark_model.fact")
    assert fact["int4_verified"] and fact["fp8_verified"] and fact["hybrid_verified"]
    res = host.run(f"python3 {TOOLS}/verify_checkpoint.py /srv/neg/model --expect-mtp --expect-hybrid")
    assert res.rc == 0, res.stdout + res.stderr
    assert not host.file("/srv/neg/model.staging.parts").exists


def test_the_start_play_does_nothing_when_the_checkpoints_are_in_place(host):
    before = _snapshot(host)
    res = run_playbook("playbooks/model-start.yml")
    assert res.rc == 0, res.output[-3000:]
    assert _recap_changed(res.output) == 0
    assert "Downloading" not in _flat(res.output) and "following it" not in _flat(res.output)
    assert _snapshot(host) == before
