"""One settings builder (issue 31, item 6): validation, the serve unit, the cluster record and the
bench record hand the argv filter the same settings, so a null knob means the same everywhere.

The expressions are read from the YAML files themselves and rendered with Ansible's filters, so a
builder that drifts (drops nulls, picks other names) fails here.
"""

from __future__ import annotations

from pathlib import Path

import jinja2.filters
import jinja2.nativetypes
import pytest
import yaml
from ansible.plugins.filter.core import FilterModule as CoreFilters
from spark_methods import SETTING_DEFAULTS, main_yml_defaults, spark_method_settings_errors, spark_serve_argv
from spark_methods import FilterModule as SparkMethodFilters

ROOT = Path(__file__).resolve().parents[2]
HOST = "spark-01"


def _group_vars() -> dict:
    out: dict = {}
    for f in sorted((ROOT / "group_vars" / "all").glob("*.yml")):
        out.update(yaml.safe_load(f.read_text()) or {})
    # main.yml's model-read defaults as Ansible resolves them for the default model
    return {**out, **main_yml_defaults()}


def _task_var(path: str, task_name_part: str, var: str) -> str:
    for task in yaml.safe_load((ROOT / path).read_text()):
        tasks = task.get("tasks", [task]) if isinstance(task, dict) else []
        for t in tasks:
            if task_name_part in t.get("name", ""):
                return t["vars"][var]
    raise AssertionError(f"no task {task_name_part!r} in {path}")


EXPRESSIONS = {
    "serve": yaml.safe_load((ROOT / "roles/serve/vars/main.yml").read_text())["_serve_settings"],
    "bench": yaml.safe_load((ROOT / "roles/bench/vars/main.yml").read_text())["_bench_settings"],
    "cluster": _task_var("roles/ray_cluster/tasks/record.yml", "Record the topology", "_settings"),
}
VALIDATE = _task_var("playbooks/validate.yml", "every serving knob", "_errors")


@pytest.fixture(scope="module")
def env():
    e = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined)
    e.filters.update(CoreFilters().filters())
    e.filters.update(SparkMethodFilters().filters())
    e.filters["default"] = e.filters["d"] = jinja2.filters.do_default  # Ansible's needs its templar
    return e


def _render(env, expr: str, host_vars: dict):
    ctx = {"hostvars": {HOST: host_vars}, "inventory_hostname": HOST, "serve_model_path": "/model",
           "spark_method_catalogue": host_vars["spark_method_catalogue"]}
    return env.from_string(expr.strip()).render(ctx)


def _cases():
    for name in sorted(set(SETTING_DEFAULTS) - {"vllm_model_path"}):
        yield pytest.param(name, None, id=f"{name}=null")
    yield pytest.param("vllm_max_num_seqs", 16, id="vllm_max_num_seqs=16")
    yield pytest.param("spec_method", "ngram", id="spec_method=ngram")
    yield pytest.param("vllm_port", 9000, id="vllm_port=9000")


@pytest.mark.parametrize(("knob", "value"), _cases())
def test_unit_bench_and_cluster_records_agree(env, knob, value):
    host_vars = {**_group_vars(), knob: value}
    settings = {where: _render(env, expr, host_vars) for where, expr in EXPRESSIONS.items()}
    assert settings["serve"] == settings["bench"] == settings["cluster"]
    assert knob in settings["serve"] and settings["serve"][knob] == value  # a null is kept, not dropped
    errors = _render(env, VALIDATE, host_vars)
    assert errors == spark_method_settings_errors(settings["serve"], host_vars["spark_method_catalogue"])
    if errors:  # validation refuses it: no stage renders anything
        return
    argvs = {where: spark_serve_argv(s, host_vars["spark_method_catalogue"]) for where, s in settings.items()}
    assert argvs["serve"] == argvs["bench"] == argvs["cluster"]


def test_a_null_max_num_seqs_is_vllms_default_everywhere(env):
    host_vars = {**_group_vars(), "vllm_max_num_seqs": None}
    for expr in EXPRESSIONS.values():
        argv = spark_serve_argv(_render(env, expr, host_vars), host_vars["spark_method_catalogue"])
        assert "--max-num-seqs" not in argv
    default = spark_serve_argv(_render(env, EXPRESSIONS["serve"], _group_vars()),
                               _group_vars()["spark_method_catalogue"])
    assert default[default.index("--max-num-seqs") + 1] == "4"


def test_the_serve_drafter_pin_overrides(env):
    host_vars = {**_group_vars(), "_serve_drafter_pin": {"spec_dflash_drafter_revision": "a" * 40}}
    ctx = {"hostvars": {HOST: host_vars}, "inventory_hostname": HOST, "serve_model_path": "/m",
           "_serve_drafter_pin": host_vars["_serve_drafter_pin"]}
    settings = env.from_string(EXPRESSIONS["serve"].strip()).render(ctx)
    assert settings["spec_dflash_drafter_revision"] == "a" * 40
    assert settings["vllm_model_path"] == "/m"
