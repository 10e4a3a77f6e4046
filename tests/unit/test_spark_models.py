"""Unit tests for filter_plugins/spark_models.py and group_vars/all/models.yml: the model catalogue."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from spark_methods import SETTING_DEFAULTS
from spark_models import SERVE_KEYS, FilterModule, spark_model_entry_errors, spark_model_errors

ROOT = Path(__file__).resolve().parents[2]
GV = ROOT / "group_vars" / "all"
MODELS = yaml.safe_load((GV / "models.yml").read_text(encoding="utf-8"))
METHODS = yaml.safe_load((GV / "methods.yml").read_text(encoding="utf-8"))
CATALOGUE = MODELS["spark_model_catalogue"]
METHOD_CAT = METHODS["spark_method_catalogue"]
VARIANTS = METHODS["spark_vllm_variants"]
BIG = "qwen3.5-122b-hybrid"
SMALL = "qwen3.6-35b-a3b-fp8"


def errors(model=BIG, method="mtp", catalogue=None, drafters=None) -> list[str]:
    return spark_model_errors(model, CATALOGUE if catalogue is None else catalogue, method, METHOD_CAT,
                              VARIANTS, drafters)


def entry_errors(mutate) -> list[str]:
    entry = copy.deepcopy(CATALOGUE[BIG])
    mutate(entry)
    return spark_model_entry_errors(BIG, entry, METHOD_CAT, VARIANTS)


# --- the catalogue file ---------------------------------------------------------------------------

def test_default_model_is_the_122b_hybrid():
    assert MODELS["model"] == BIG


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_every_entry_is_sound(name):
    assert spark_model_entry_errors(name, CATALOGUE[name], METHOD_CAT, VARIANTS) == []


# The knobs the model's entry now sets, with the literal values they had before issue 49 (commit e5ec2a4):
# the default model must resolve every one of them unchanged (same units, paths, facts and stage inputs).
BEFORE_ISSUE_49 = {
    "vllm_served_model_name": "qwen3.5-122b", "vllm_max_model_len": 262144, "vllm_reasoning_parser": "qwen3",
    "vllm_tool_call_parser": "qwen3_coder", "vllm_load_format": "fastsafetensors", "vllm_lm_head_int8": True,
    "spark_model_dir": "/srv/models/qwen3.5-122b-hybrid", "vllm_serve_extra_args": [],
    "model_fetch_int4_repo": "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "model_fetch_int4_revision": "main",
    "model_fetch_fp8_repo": "Qwen/Qwen3.5-122B-A10B-FP8", "model_fetch_fp8_revision": "main",
    "model_fetch_fp8_mode": "extract",
    "spark_checkpoint_bytes": {"int4": 80000000000, "fp8_extract": 600000000, "fp8_full": 130000000000,
                               "hybrid": 76000000000,
                               "drafters": {"eagle3": 6000000000, "dflash": 8000000000}},
}
PLAYBOOK_BIN = Path(sys.executable).parent / "ansible-playbook"


def resolve(tmp_path: Path, names, **extra) -> dict:
    """The values Ansible resolves for ``names`` from group_vars/all, with ``extra`` as -e."""
    out = tmp_path / "out.json"
    play = tmp_path / "play.yml"
    play.write_text(f"""
- hosts: spark
  gather_facts: false
  tasks:
    - ansible.builtin.copy:
        dest: {out}
        content: "{{{{ {{{', '.join(f"'{n}': {n}" for n in names)}}} | to_json }}}}"
        mode: "0644"
      delegate_to: localhost
""")
    (tmp_path / "group_vars").symlink_to(ROOT / "group_vars")
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}
    res = subprocess.run([str(PLAYBOOK_BIN), "-i", str(ROOT / "inventory" / "hosts.yml"), str(play),
                          "-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra})],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not PLAYBOOK_BIN.exists(), reason="ansible-playbook not in this venv")
def test_default_model_resolves_todays_values(tmp_path: Path):
    assert resolve(tmp_path, BEFORE_ISSUE_49) == BEFORE_ISSUE_49


@pytest.mark.skipif(not PLAYBOOK_BIN.exists(), reason="ansible-playbook not in this venv")
def test_another_model_sets_the_knobs_and_a_set_knob_wins(tmp_path: Path):
    names = ["vllm_served_model_name", "vllm_max_model_len", "vllm_lm_head_int8", "spark_model_dir",
             "vllm_load_format", "vllm_serve_extra_args"]
    got = resolve(tmp_path, names, model=SMALL, vllm_load_format="safetensors")
    assert got == {"vllm_served_model_name": "qwen3.6-35b-a3b", "vllm_max_model_len": 65536,
                   "vllm_lm_head_int8": False, "spark_model_dir": "/srv/models/qwen3.6-35b-a3b-fp8",
                   "vllm_load_format": "safetensors", "vllm_serve_extra_args": ["--kv-cache-dtype", "fp8"]}


@pytest.mark.skipif(not PLAYBOOK_BIN.exists(), reason="ansible-playbook not in this venv")
def test_a_model_served_as_fetched_leaves_the_hybrid_knobs_empty(tmp_path: Path):
    """model_fetch's argument spec templates every hybrid knob even for a plain model: they must resolve."""
    names = ["model_fetch_int4_repo", "model_fetch_int4_revision", "model_fetch_fp8_repo",
             "model_fetch_fp8_revision", "model_fetch_fp8_mode", "spark_checkpoint_bytes"]
    got = resolve(tmp_path, names, model=SMALL)
    assert got == {"model_fetch_int4_repo": "", "model_fetch_int4_revision": "", "model_fetch_fp8_repo": "",
                   "model_fetch_fp8_revision": "", "model_fetch_fp8_mode": "extract",
                   "spark_checkpoint_bytes": {"checkpoint": 40_000_000_000,
                                              "drafters": got["spark_checkpoint_bytes"]["drafters"]}}


@pytest.mark.skipif(not PLAYBOOK_BIN.exists(), reason="ansible-playbook not in this venv")
def test_an_entry_of_the_owners_own_is_selected_like_the_catalogues(tmp_path: Path):
    mine = copy.deepcopy(CATALOGUE[SMALL])
    mine["serve"]["vllm_served_model_name"] = "mine"
    mine["model_dir"] = "my-model"
    got = resolve(tmp_path, ["vllm_served_model_name", "spark_model_dir"], model="my-model",
                  spark_model_catalogue_local={"my-model": mine})
    assert got == {"vllm_served_model_name": "mine", "spark_model_dir": "/srv/models/my-model"}


def test_knob_defaults_read_the_default_models_entry():
    """The argv filter's defaults (main.yml) resolve a model-read default to the default model's value."""
    for knob, value in CATALOGUE[BIG]["serve"].items():
        assert SETTING_DEFAULTS[knob] == value, knob
    assert SETTING_DEFAULTS["spark_model_dir"] == "/srv/models/" + CATALOGUE[BIG]["model_dir"]
    assert SETTING_DEFAULTS["vllm_serve_extra_args"] == CATALOGUE[BIG]["extra_args"]
    assert CATALOGUE[BIG]["methods"]["dflash"]["drafter"] == SETTING_DEFAULTS["spec_dflash_drafter"]
    assert CATALOGUE[BIG]["vllm_variant"] == METHOD_CAT["mtp"]["vllm_variant"]
    assert set(CATALOGUE[BIG]["methods"]) == set(METHOD_CAT)


def test_35b_entry_keeps_the_122b_int8_head_off_and_is_pinned():
    entry = CATALOGUE[SMALL]
    assert entry["serve"]["vllm_lm_head_int8"] is False
    assert set(entry["sizes"]["disk_bytes"]) == {"checkpoint"}
    assert re.fullmatch(r"[0-9a-f]{40}", entry["checkpoints"][0]["revision"])
    assert entry["assembly"] == "none"
    assert entry["model_dir"] != CATALOGUE[BIG]["model_dir"]


def test_serve_keys_are_what_main_yml_reads_from_the_entry():
    text = (ROOT / "group_vars/all/main.yml").read_text(encoding="utf-8")
    assert set(re.findall(r"spark_model_entry\.serve\.(\w+)", text)) == set(SERVE_KEYS)


@pytest.mark.parametrize(("mutate", "says"), [
    (lambda e: e["serve"].update(spec_num_speculative_tokens=3),
     "serve.spec_num_speculative_tokens: not a setting of the model"),
    (lambda e: e["serve"].pop("vllm_tool_call_parser"), "serve lacks vllm_tool_call_parser"),
])
def test_serve_holds_exactly_the_models_own_settings(mutate, says):
    assert any(says in m for m in entry_errors(mutate))


def test_an_unknown_serve_setting_is_refused_at_deploy():
    cat = copy.deepcopy(CATALOGUE)
    cat[SMALL]["serve"]["vllm_max_model_len"] = None
    assert spark_model_entry_errors(SMALL, cat[SMALL], METHOD_CAT, VARIANTS) == []
    msgs = errors(model=SMALL, method="mtp", catalogue=cat)
    assert any("serve.vllm_max_model_len unknown (null)" in m for m in msgs)


def test_serve_keys_are_main_yml_knobs():
    for entry in CATALOGUE.values():
        assert set(entry["serve"]) <= set(SETTING_DEFAULTS)


# --- the model x method check --------------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(METHOD_CAT))
def test_default_model_deploys_with_every_method(method):
    assert errors(method=method, drafters={"dflash": "z-lab/Qwen3.5-122B-A10B-DFlash", "eagle3": ""}) == []


def test_unknown_model_lists_the_known_ones():
    (msg,) = errors(model="qwen3-8b")
    assert "model='qwen3-8b' is not in the model catalogue" in msg
    assert BIG in msg and SMALL in msg and "group_vars/all/models.yml" in msg


def test_an_unknown_method_is_left_to_the_method_check():
    assert errors(method="medusa") == []


def test_empty_catalogue_is_refused():
    (msg,) = spark_model_errors(BIG, {}, "mtp", METHOD_CAT, VARIANTS)
    assert "spark_model_catalogue is empty" in msg


def test_method_the_model_does_not_support():
    msgs = errors(model=SMALL, method="dflash")
    assert any("spec_method='dflash' is not supported by model=qwen3.6-35b-a3b-fp8; it supports: "
               "baseline, ngram, mtp" in m for m in msgs)


def test_unknown_size_is_refused_where_preflight_needs_it():
    cat = copy.deepcopy(CATALOGUE)
    cat[SMALL]["sizes"]["disk_bytes"] = {"checkpoint": None}
    msgs = errors(model=SMALL, method="mtp", catalogue=cat)
    assert any("its size on disk is unknown (sizes.disk_bytes checkpoint null)" in m
               and "preflight's disk check" in m for m in msgs)


def test_a_plain_checkpoint_with_its_size_known_deploys():
    cat = copy.deepcopy(CATALOGUE)
    cat[SMALL]["sizes"]["disk_bytes"] = {"checkpoint": 40_000_000_000}
    assert errors(model=SMALL, method="mtp", catalogue=cat) == []


@pytest.mark.parametrize(("model", "disk", "want"), [
    (SMALL, {"int4": 1}, "assembly none writes checkpoint"),
    (BIG, {"checkpoint": 1}, "assembly hybrid_merge writes fp8_extract, fp8_full, hybrid, int4"),
])
def test_disk_sizes_must_name_what_the_assembly_writes(model, disk, want):
    cat = copy.deepcopy(CATALOGUE)
    cat[model]["sizes"]["disk_bytes"] = disk
    assert any(want in m for m in errors(model=model, method="mtp", catalogue=cat))


def test_a_drafter_of_another_model_is_refused():
    cat = copy.deepcopy(CATALOGUE)
    cat[SMALL]["methods"]["dflash"] = {"drafter": "z-lab/Qwen3.6-35B-A3B-DFlash"}
    msgs = errors(model=SMALL, method="dflash", catalogue=cat,
                  drafters={"dflash": "z-lab/Qwen3.5-122B-A10B-DFlash"})
    assert any("spec_dflash_drafter='z-lab/Qwen3.5-122B-A10B-DFlash' is the dflash drafter of "
               f"{BIG}, not of model={SMALL}; set spec_dflash_drafter to z-lab/Qwen3.6-35B-A3B-DFlash" in m
               for m in msgs)


def test_a_drafter_of_no_catalogue_model_is_the_owners_choice():
    assert errors(method="eagle3", drafters={"eagle3": "/models/my-eagle3"}) == []


def test_a_broken_entry_is_reported_before_the_method():
    cat = copy.deepcopy(CATALOGUE)
    cat[BIG]["vllm_variant"] = "v9"
    (msg,) = errors(catalogue=cat)
    assert "spark_model_catalogue.qwen3.5-122b-hybrid.vllm_variant='v9' is not a build variant" in msg


# --- the entry check, by message -----------------------------------------------------------------

@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda e: e.pop("model_dir"), "lacks model_dir"),
    (lambda e: e.update(colour="red"), "has unknown keys colour"),
    (lambda e: e.update(assembly="gguf"), "assembly='gguf' must be one of hybrid_merge, none"),
    (lambda e: e["checkpoints"][0].update(revision="v1.0"), "revision='v1.0' must be a commit (40 hex)"),
    (lambda e: e["checkpoints"][0].update(repo="not a repo"), "repo='not a repo' is not a Hub repo id"),
    (lambda e: e["checkpoints"][0].update(mode="partial"), "mode='partial' must be one of full, extract"),
    (lambda e: e["checkpoints"][0].pop("mode"), "checkpoints[0] has missing mode keys"),
    (lambda e: e.update(checkpoints=[]), "checkpoints must be a non-empty list"),
    (lambda e: e["checkpoints"][1].update(role="int4"), "the roles ['int4', 'int4'] repeat"),
    (lambda e: e.update(assembly="none"), "assembly none serves one checkpoint as fetched"),
    (lambda e: e["checkpoints"].pop(), "assembly hybrid_merge merges an int4 and an fp8 checkpoint"),
    (lambda e: e.update(model_dir="srv/x"), "model_dir='srv/x' must be a directory name"),
    (lambda e: e.update(model_dir="/srv/models/x"), "model_dir='/srv/models/x' must be a directory name"),
    (lambda e: e.update(model_dir=".."), "model_dir='..' must be a directory name"),
    (lambda e: e["sizes"].pop("memory_bytes"), "sizes must be a mapping with disk_bytes and memory_bytes"),
    (lambda e: e["sizes"]["disk_bytes"].update(int4="80G"), "disk_bytes.int4='80G' must be a positive"),
    (lambda e: e["sizes"].update(memory_bytes=-1), "memory_bytes=-1 must be a positive integer or null"),
    (lambda e: e["serve"].update(vllm_colour=1), "serve.vllm_colour is not a serve knob of"),
    (lambda e: e.update(server_env={"lower": "1"}), "server_env must map upper-case variable names"),
    (lambda e: e.update(extra_args=["--port", "1"]), "extra_args: extra_args[0]='--port' repeats an option"),
    (lambda e: e["methods"].update(medusa={}), "methods.medusa is not in the method catalogue"),
    (lambda e: e["methods"].update(mtp={"drafter": "x/y"}), "methods.mtp names a drafter, but mtp takes"),
    (lambda e: e["methods"].update(mtp={"tokens": 3}), "methods.mtp has unknown keys tokens"),
    (lambda e: e.update(methods={}), "methods must map at least one method"),
])
def test_entry_errors_by_message(mutate, expected):
    msgs = entry_errors(mutate)
    assert any(expected in m for m in msgs), msgs


def test_entry_name_and_type():
    assert "the name must be lower case" in spark_model_entry_errors("Big Model", {}, METHOD_CAT, VARIANTS)[0]
    assert "must be a mapping" in spark_model_entry_errors("x", [], METHOD_CAT, VARIANTS)[0]


def test_filter_module_and_validate_play():
    assert set(FilterModule().filters()) == {"spark_model_entry_errors", "spark_model_errors"}
    play = (ROOT / "playbooks" / "validate.yml").read_text(encoding="utf-8")
    assert "model | spark_model_errors(spark_model_catalogue | combine(spark_model_catalogue_local)" in play
