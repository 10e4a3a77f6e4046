"""Misspelt knobs and tags (filter_plugins/spark_knobs.py, issue 31 items 1 and 2), and every
molecule scenario's and inventory's own variables still passing the check."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from spark_knobs import ALLOW_VAR, FilterModule, spark_known_knobs, spark_tag_errors, spark_unknown_knobs

ROOT = Path(__file__).resolve().parents[2]
KNOWN = spark_known_knobs()


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("spec_methd", "spec_method"),
        ("spec_num_speculativ_tokens", "spec_num_speculative_tokens"),
        ("vllm_gpu_memory_utilisation", "vllm_gpu_memory_utilization"),
        ("bench_concurency", "bench_concurrency"),
        ("serve_ready_timout", "serve_ready_timeout"),
    ],
)
def test_a_misspelt_knob_is_refused_with_the_closest_name(typo, meant):
    (error,) = spark_unknown_knobs({typo: "x", "spec_method": "mtp"})
    assert error.startswith(f"{typo} is not a variable of this toolkit (did you mean {meant}?)")
    assert ALLOW_VAR in error


def test_names_outside_the_namespaces_and_known_names_pass():
    variables = {"inventory_hostname": "h", "ansible_host": "x", "my_own": 1, "molecule_yml": {},
                 "spec_method": "mtp", "vllm_max_num_seqs": None, "spark_link_addresses": [],
                 # role-internal: set by the cluster play's set_fact, a register name
                 "spark_nnodes": 2, "spark_cluster_nodes": ["a", "b"]}
    assert spark_unknown_knobs(variables) == []


def test_the_list_is_derived_from_the_argument_specs_and_group_vars():
    specs = yaml.safe_load((ROOT / "roles/bench/meta/argument_specs.yml").read_text())
    assert set(specs["argument_specs"]["main"]["options"]) <= set(KNOWN["knobs"])
    assert "spec_method" in KNOWN["knobs"] and "spark_method_catalogue" in KNOWN["knobs"]
    prefixes = {"spark_", "vllm_", "spec_", "bench_", "serve_", "model_", "ray_", "preflight_"}
    assert prefixes == set(KNOWN["prefixes"])


def test_a_new_knob_in_a_project_is_known_there(tmp_path):
    (tmp_path / "roles/r/meta").mkdir(parents=True)
    (tmp_path / "roles/r/meta/argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    options:\n      zeta_new_knob: {type: int}\n")
    assert spark_unknown_knobs({"zeta_new_knob": 1, "zeta_new_knb": 2}, str(tmp_path)) == [
        "zeta_new_knb is not a variable of this toolkit (did you mean zeta_new_knob?); if it is your own, "
        f"list it in {ALLOW_VAR}"]


def test_owners_names_and_patterns_pass_when_listed():
    variables = {"spark_site_label": "lab", "vllm_team_a": 1, "vllm_team_b": 2, "spec_methd": "x",
                 ALLOW_VAR: ["spark_site_label", "vllm_team_*"]}
    (error,) = spark_unknown_knobs(variables)
    assert error.startswith("spec_methd ")


@pytest.mark.parametrize("bad", ["spark_site_label", [1], {"a": 1}, [""]])
def test_a_malformed_opt_out_is_named(bad):
    errors = spark_unknown_knobs({ALLOW_VAR: bad})
    assert errors and errors[0].startswith(f"{ALLOW_VAR} must be a list")


def test_an_unknown_tag_is_refused_naming_the_stage_tags():
    errors = spark_tag_errors(["serv"], [])
    assert errors[0] == "--tags serv: no play or task has this tag (did you mean serve?)"
    assert errors[-1] == "the stage tags are preflight, model, build, cluster, serve, ops, monitoring, bench"
    assert spark_tag_errors(["all"], []) == []
    assert spark_tag_errors(["serve", "bench"], ["ops"]) == []
    assert spark_tag_errors(["always"], ["never"]) == []
    # what molecule passes
    assert spark_tag_errors(["all"], ["molecule-notest", "notest", "molecule-idempotence-notest"]) == []
    assert spark_tag_errors(["notest"], [])[0].startswith("--tags notest:")
    assert spark_tag_errors(["serve"], ["benhc"])[0].startswith("--skip-tags benhc:")


def test_stage_tags_are_the_plays_of_site_yml():
    site = (ROOT / "site.yml").read_text()
    for tag in KNOWN["stage_tags"]:
        assert f"tags: [{tag}]" in "".join((ROOT / "playbooks").joinpath(p).read_text()
                                           for p in re.findall(r"playbooks/([\w-]+\.yml)", site))


def test_filters_are_registered():
    assert set(FilterModule().filters()) == {"spark_unknown_knobs", "spark_tag_errors", "spark_known_knobs"}


# ---- every scenario's and inventory's own variables pass (a scenario cannot break silently)


def _inventory_vars(node, out: set[str]) -> None:
    if not isinstance(node, dict):
        return
    for host_vars in (node.get("hosts") or {}).values():
        out.update(host_vars or {})
    out.update(node.get("vars") or {})
    for child in (node.get("children") or {}).values():
        _inventory_vars(child, out)


def _play_vars(node, out: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _play_vars(item, out)
    elif isinstance(node, dict):
        out.update(k for k in node.get("vars") or {} if isinstance(k, str))
        facts = node.get("ansible.builtin.set_fact") or node.get("set_fact")
        if isinstance(facts, dict):
            out.update(facts)
        for value in node.values():
            _play_vars(value, out)


def _test_extra_vars(path: Path, out: set[str], allowed: list[str]) -> None:
    """Keys of dict literals (extra vars of run_playbook) and `name=value` strings (raw -e) in a test,
    leaving out dicts inside json.dumps(...) (results written, not variables); the opt-out lists a
    test passes go to ``allowed``."""
    tree = ast.parse(path.read_text())
    misspelt: set[str] = set()  # a module-level MISSPELT = {typo: meant}: names misspelt on purpose
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MISSPELT" for t in node.targets):
            misspelt |= set(ast.literal_eval(node.value))
    skip = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
            and getattr(call.func, "attr", "") == "dumps" for n in ast.walk(call)}
    for node in ast.walk(tree):
        if id(node) in skip or (isinstance(node, ast.Constant) and isinstance(node.value, str)
                                and node.value in misspelt):
            continue
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value not in misspelt:
                    out.add(key.value)
                    if key.value == ALLOW_VAR:
                        allowed += ast.literal_eval(value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = re.fullmatch(r"([a-z_][a-z0-9_]*)=.*", node.value, re.S)
            if m and m.group(1) not in misspelt:
                out.add(m.group(1))


def _scenario_variables(scenario: Path) -> dict:
    names: set[str] = set()
    allowed: list[str] = []
    for f in sorted(scenario.glob("host_vars/**/*.yml")) + sorted(scenario.glob("group_vars/**/*.yml")):
        data = yaml.safe_load(f.read_text()) or {}
        names.update(data)
        allowed += data.get(ALLOW_VAR) or []
    mol = yaml.safe_load((scenario / "molecule.yml").read_text()) or {}
    inventory = (mol.get("provisioner") or {}).get("inventory") or {}
    for kind in ("host_vars", "group_vars"):
        block = inventory.get(kind)
        if isinstance(block, dict):
            for values in block.values():
                names.update(values or {})
                allowed += (values or {}).get(ALLOW_VAR) or []
    for f in sorted(scenario.glob("*.yml")):
        _play_vars(yaml.safe_load(f.read_text()), names)
    for f in sorted(scenario.glob("tests/*.py")):
        _test_extra_vars(f, names, allowed)
    return {**dict.fromkeys(names, None), ALLOW_VAR: allowed}


SCENARIOS = sorted(p.parent for p in (ROOT / "molecule").glob("*/molecule.yml"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_every_scenarios_own_variables_pass(scenario):
    variables = _scenario_variables(scenario)
    assert spark_unknown_knobs(variables) == []
    # and the check would see a typo there
    assert spark_unknown_knobs({**variables, "spec_methd": "x"})


@pytest.mark.parametrize("inventory", sorted((ROOT / "inventory").rglob("*.yml")),
                         ids=lambda p: p.name)
def test_every_shipped_inventory_passes(inventory):
    names: set[str] = set()
    for group in (yaml.safe_load(inventory.read_text()) or {}).values():
        _inventory_vars(group, names)
    assert names
    assert spark_unknown_knobs(dict.fromkeys(names)) == []


def test_the_scenario_scan_leaves_out_only_the_declared_typos():
    variables = _scenario_variables(ROOT / "molecule" / "preflight")
    assert "preflight_testbed" in variables  # a raw -e of its tests
    assert "spec_methd" not in variables


def test_the_scenario_scan_finds_test_extra_vars():
    variables = _scenario_variables(ROOT / "molecule" / "vllm_build")
    assert "vllm_build_test_fake_arch" in variables  # passed with -e by its verify tests
    assert "vllm_build_test_*" in variables[ALLOW_VAR]
