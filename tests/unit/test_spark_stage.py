"""Unit tests for issue 14's stage shortcut, scripts/sparkllm/stage/gate.py: the fingerprint and decision on
the controller (the filters of filter_plugins/spark_stage.py) and the probe and record on the host
(library/spark_stage.py, which imports it as ansible.module_utils.sparkllm.stage.gate)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from spark_stage import FilterModule, spark_stage_after_record, spark_stage_gate
from sparkllm.stage import gate as st

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "library" / "spark_stage.py"


# --- the controller side: inputs, fingerprint, decision ---------------------------------------

def test_inputs_are_the_knobs_the_stage_declares():
    serve = st.input_names("serve")
    assert {"serve_unit_prefix", "vllm_port", "spec_method", "spark_method_catalogue"} <= set(serve)
    model = st.input_names("model")
    assert {"model_fetch_source", "model_hybrid_out_dir", "spark_model_root"} <= set(model)
    # the model roles never read the method: switching it must not rerun the model stage
    assert "spec_method" not in model
    # force knobs ask for work; they are never inputs (a forced run would otherwise change the print)
    assert "model_hybrid_force" not in model and "model_fetch_update" not in model
    assert st.force_names("model") == ["model_fetch_update", "model_hybrid_force"]
    assert FilterModule().filters()["spark_stage_input_names"]("bench") == st.input_names("bench")


def test_the_bad_driver_opt_in_reruns_preflight_and_serve():
    # one knob read by both stages: accepting a 590 driver (preflight) and serving eager (serve)
    for stage in ("preflight", "serve"):
        assert "spark_bad_driver_enforce_eager" in st.input_names(stage), stage
        off = {"spec_method": "mtp", "spark_bad_driver_enforce_eager": False}
        fp = spark_stage_gate(stage, off, {"salt": "s"})["fingerprint"]
        on = dict(off, spark_bad_driver_enforce_eager=True)
        assert spark_stage_gate(stage, on, _probe(stage, fp))["current"] is False, stage
        assert spark_stage_gate(stage, off, _probe(stage, fp))["current"] is True, stage


def test_unknown_stage_is_refused_with_the_list():
    stages = "preflight, build, model, serve, bench, ops "
    with pytest.raises(ValueError, match=f"unknown stage 'deploy'.*{stages}"):
        st.input_names("deploy")


def _probe(stage: str, fingerprint: str, *, match: bool = True, salt: str = "s", **others) -> dict:
    stages = {stage: {"fingerprint": fingerprint, "observed": "o1", "outputs_match": match,
                      "drift": [] if match else ["image x: missing"]}}
    stages.update(others)
    return {"salt": salt, "stages": stages}


def test_a_host_without_a_record_runs_the_stage():
    gate = spark_stage_gate("serve", {"spec_method": "mtp"}, {})
    assert gate["current"] is False and "no record" in gate["reason"]
    assert len(gate["fingerprint"]) == 64


def test_unchanged_inputs_and_outputs_end_the_stage():
    hv = {"spec_method": "mtp", "vllm_port": 8000}
    fp = spark_stage_gate("serve", hv, {"salt": "s"})["fingerprint"]
    gate = spark_stage_gate("serve", hv, _probe("serve", fp))
    assert gate["current"] is True and gate["fingerprint"] == fp


def test_a_changed_input_runs_the_stage():
    fp = spark_stage_gate("serve", {"spec_method": "mtp"}, {"salt": "s"})["fingerprint"]
    gate = spark_stage_gate("serve", {"spec_method": "ngram"}, _probe("serve", fp))
    assert gate["current"] is False and "inputs changed" in gate["reason"]
    # a variable the stage does not read changes nothing
    other = {"spec_method": "mtp", "model_fetch_source": "mirror"}
    assert spark_stage_gate("serve", other, _probe("serve", fp))["current"] is True


def test_drifted_outputs_run_the_stage_and_say_what_drifted():
    hv = {"spec_method": "mtp"}
    fp = spark_stage_gate("build", hv, {"salt": "s"})["fingerprint"]
    gate = spark_stage_gate("build", hv, _probe("build", fp, match=False))
    assert gate["current"] is False and "image x: missing" in gate["reason"]


def test_force_runs_the_stage():
    hv = {"spec_method": "mtp"}
    fp = spark_stage_gate("model", hv, {"salt": "s"})["fingerprint"]
    assert spark_stage_gate("model", hv, _probe("model", fp), True)["current"] is False
    gate = spark_stage_gate("model", dict(hv, model_hybrid_force=True), _probe("model", fp))
    assert gate["current"] is False and "model_hybrid_force" in gate["reason"]
    # the knob set to false is no input: the stage stays current
    assert spark_stage_gate("model", dict(hv, model_hybrid_force="false"), _probe("model", fp))["current"]


def test_a_new_upstream_record_runs_the_stages_after_it():
    hv = {"spec_method": "mtp"}
    upstream = {"model": {"fingerprint": "m1", "observed": "o1"},
                "build": {"fingerprint": "b1", "observed": "o1"}}
    fp = spark_stage_gate("serve", hv, {"salt": "s", "stages": upstream})["fingerprint"]
    probe = _probe("serve", fp, **upstream)
    assert spark_stage_gate("serve", hv, probe)["current"] is True
    # the model stage completed again with a new merged model: serve (and bench after it) must run
    rerun = spark_stage_after_record(probe, "model", {"entry": {"fingerprint": "m1", "observed": "o2"}})
    assert rerun["stages"]["model"]["outputs_match"] is True
    assert spark_stage_gate("serve", hv, rerun)["current"] is False
    # preflight builds on nothing: the model's new record leaves it alone
    pf = spark_stage_gate("preflight", hv, {"salt": "s"})["fingerprint"]
    assert spark_stage_gate("preflight", hv, _probe("preflight", pf, **rerun["stages"]))["current"] is True


def test_secrets_enter_as_an_hmac_under_the_host_salt():
    token = "hf_" + "x" * 34
    values = st.input_values("serve", {"serve_hf_token": token}, "salt1")
    assert token not in json.dumps(values)
    assert values["serve_hf_token"].startswith("hmac:")
    assert st.input_values("serve", {"serve_hf_token": token}, "salt2") != values
    assert st.input_values("serve", {"serve_hf_token": token + "y"}, "salt1") != values
    # a rotated token reruns the stage that writes it
    fp = spark_stage_gate("serve", {"serve_hf_token": token}, {"salt": "s"})["fingerprint"]
    assert not spark_stage_gate("serve", {"serve_hf_token": "hf_other"}, _probe("serve", fp))["current"]


class _Raising(dict):
    def __getitem__(self, key):
        if key == "vllm_port":
            raise RuntimeError("template error")
        return super().__getitem__(key)


def test_an_unresolvable_value_is_a_stable_input():
    hv = _Raising(vllm_port=None, spec_method="mtp")
    values = st.input_values("serve", hv, "s")
    assert values["vllm_port"] == "<unresolved: RuntimeError>"
    assert st.input_values("serve", hv, "s") == values


def test_a_changed_toolkit_file_changes_only_the_stages_that_run_it(tmp_path):
    root = tmp_path / "toolkit"
    for d in ("roles", "playbooks", "filter_plugins", "group_vars", "library", "scripts", "templates",
              "patches"):  # playbooks/group_vars is a link to ../group_vars
        shutil.copytree(ROOT / d, root / d, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "site.yml", root / "site.yml")
    stages = st.stage_names(root)
    before = {s: st.files_digest(s, root) for s in stages}
    (root / "roles" / "bench" / "tasks" / "run.yml").write_text("# changed\n", encoding="utf-8")
    after = {s: st.files_digest(s, root) for s in stages}
    assert [s for s in stages if before[s] != after[s]] == ["bench"]
    # a task file the build stage includes from another role (its rescue stops the download) reruns
    # build and model, not serve; the rest of that role reruns only the model stage
    (root / "roles" / "model_fetch" / "tasks" / "stop.yml").write_text("# changed\n", encoding="utf-8")
    again = {s: st.files_digest(s, root) for s in stages}
    assert [s for s in stages if again[s] != after[s]] == ["build", "model"]
    (root / "roles" / "model_fetch" / "tasks" / "wait.yml").write_text("# changed\n", encoding="utf-8")
    assert [s for s in stages if st.files_digest(s, root) != again[s]] == ["model"]
    (root / "scripts" / "hybrid_merge.py").write_text("# changed\n", encoding="utf-8")
    assert all(st.files_digest(s, root) != again[s] for s in stages)


def test_a_stages_roles_are_read_from_its_playbooks():
    # spark_tools: serve's meta dependency
    assert st.stage_roles("serve") == {"serve": None, "spark_tools": None}
    build = st.stage_roles("build")
    assert build["vllm_build"] is None and build["model_fetch"] == {"stop.yml"}
    assert build["spark_tools"] == {"stage_gate.yml", "stage_record.yml"}
    assert set(st.stage_roles("model")) == {"model_fetch", "model_hybrid", "spark_tools"}


# --- the host side: the spark_stage module ----------------------------------------------------

def run_module(tmp_path: Path, args: dict, *, check: bool = False, path_prefix: Path | None = None) -> dict:
    if check:
        args = dict(args, _ansible_check_mode=True)
    argfile = tmp_path / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    env = dict(os.environ)
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    # as Ansible ships it: scripts/ is module_utils (ansible.cfg): sparkllm is ansible.module_utils.sparkllm
    boot = ("import runpy, sys, ansible.module_utils as mu; mu.__path__.append(sys.argv[1]); "
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", boot, str(ROOT / "scripts"), str(MODULE), str(argfile)],
                          capture_output=True, text=True, env=env, check=False)
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


def _fake_bin(tmp_path: Path) -> Path:
    """docker knows one image (its ID in a file); systemctl says active for one unit."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text(
        '#!/bin/sh\n[ "$5" = "vllm:ok" ] && cat "$(dirname "$0")/image-id" && exit 0\nexit 1\n')
    (bindir / "systemctl").write_text('#!/bin/sh\n[ "$2" = "good.service" ] && echo active && exit 0\n'
                                      'echo inactive; exit 3\n')
    (bindir / "image-id").write_text("sha256:1111\n")
    for f in ("docker", "systemctl"):
        (bindir / f).chmod(0o755)
    return bindir


def test_record_then_probe_matches_and_names_every_drift(tmp_path):
    facts = tmp_path / "facts"
    model = tmp_path / "model"
    model.mkdir()
    (model / "a.safetensors").write_bytes(b"x" * 10)
    env_file = tmp_path / "mtp.env"
    env_file.write_text("A=1\n")
    bindir = _fake_bin(tmp_path)
    outputs = {"dirs": [str(model)], "files": [str(env_file)], "images": ["vllm:ok"],
               "units": ["good.service"], "boot": True}
    rec = run_module(tmp_path, {"state": "record", "facts_dir": str(facts), "stage": "serve",
                                "fingerprint": "f1", "salt": "salt1", "outputs": outputs},
                     path_prefix=bindir)
    assert rec["changed"] is True and rec["entry"]["fingerprint"] == "f1"
    fact = facts / "spark_stage.fact"
    assert stat.S_IMODE(fact.stat().st_mode) == 0o600
    data = json.loads(fact.read_text())
    assert data["salt"] == "salt1" and data["stages"]["serve"]["seen"]["image vllm:ok"] == "sha256:1111"

    probe = run_module(tmp_path, {"facts_dir": str(facts)}, path_prefix=bindir)
    assert probe["changed"] is False and probe["salt"] == "salt1"
    assert probe["stages"]["serve"] == {"fingerprint": "f1", "observed": rec["entry"]["observed"],
                                        "outputs_match": True, "drift": []}
    # recording the same again changes nothing (the idempotence of a full rerun)
    again = run_module(tmp_path, {"state": "record", "facts_dir": str(facts), "stage": "serve",
                                  "fingerprint": "f1", "salt": "other", "outputs": outputs},
                       path_prefix=bindir)
    assert again["changed"] is False and again["salt"] == "salt1"

    # drift: a shard replaced, the env file edited, the image rebuilt, the unit stopped
    (model / "a.safetensors").write_bytes(b"y" * 11)
    env_file.write_text("A=2\n")
    (bindir / "image-id").write_text("sha256:2222\n")
    (bindir / "systemctl").write_text("#!/bin/sh\necho failed; exit 3\n")
    probe = run_module(tmp_path, {"facts_dir": str(facts)}, path_prefix=bindir)
    drift = probe["stages"]["serve"]["drift"]
    assert probe["stages"]["serve"]["outputs_match"] is False
    assert {d.split(":")[0] for d in drift} == {f"dir {model}", f"file {env_file}", "image vllm",
                                                "unit good.service"}
    shutil.rmtree(model)
    probe = run_module(tmp_path, {"facts_dir": str(facts)}, path_prefix=bindir)
    assert f"dir {model}: missing" in probe["stages"]["serve"]["drift"]


def test_probe_of_a_fresh_host_offers_a_salt_and_no_stage(tmp_path):
    probe = run_module(tmp_path, {"facts_dir": str(tmp_path / "none")})
    assert probe["stages"] == {} and len(probe["salt"]) == 32
    assert not (tmp_path / "none").exists()


def test_check_mode_records_nothing(tmp_path):
    facts = tmp_path / "facts"
    rec = run_module(tmp_path, {"state": "record", "facts_dir": str(facts), "stage": "preflight",
                                "fingerprint": "f", "outputs": {"boot": True}}, check=True)
    assert rec["changed"] is True and not facts.exists()


def test_unknown_output_kind_and_missing_fingerprint_are_refused(tmp_path):
    bad = run_module(tmp_path, {"state": "record", "facts_dir": str(tmp_path), "stage": "x",
                                "fingerprint": "f", "outputs": {"containers": ["a"]}})
    assert bad["failed"] and "unknown output kind(s) containers" in bad["msg"]
    bad = run_module(tmp_path, {"state": "record", "facts_dir": str(tmp_path), "stage": "x"})
    assert bad["failed"] and "fingerprint" in bad["msg"]
    assert not (tmp_path / "spark_stage.fact").exists()


def test_a_custom_template_is_an_input_with_the_knobs_it_reads(tmp_path):
    """A Dockerfile template outside the toolkit: its content and the variables it mentions are inputs,
    facts are not (they change on every run)."""
    tpl = tmp_path / "Dockerfile.j2"
    tpl.write_text("FROM x\nRUN echo {{ my_test_knob | default('a') }} {{ ansible_date_time }}\n")
    hv = {"vllm_build_dockerfile_template": str(tpl), "ansible_date_time": {"epoch": "1"}}
    fp = spark_stage_gate("build", hv, {"salt": "s"})["fingerprint"]
    probe = _probe("build", fp)
    assert spark_stage_gate("build", dict(hv, ansible_date_time={"epoch": "2"}), probe)["current"] is True
    gate = spark_stage_gate("build", dict(hv, my_test_knob="b"), probe)
    assert gate["current"] is False and "inputs changed" in gate["reason"]
    tpl.write_text(tpl.read_text() + "RUN true\n")
    assert spark_stage_gate("build", hv, probe)["current"] is False
    values = st.input_values("build", hv, "s")
    assert "<content of vllm_build_dockerfile_template>" in values and "ansible_date_time" not in values
