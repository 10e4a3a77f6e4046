"""Issue 44: the INT8 LM head is the project's default, the server container gets the directory patch 0002
caches its autotuned tiles in (inside the persisted vllm cache mount), and the bench records the head in
each run's meta. The expressions are read from the roles' YAML files and rendered with Ansible's filters."""

from __future__ import annotations

from pathlib import Path

import jinja2.filters
import jinja2.nativetypes
import pytest
import yaml
from ansible.plugins.filter.core import FilterModule as CoreFilters

ROOT = Path(__file__).resolve().parents[2]
SERVE_VARS = yaml.safe_load((ROOT / "roles/serve/vars/main.yml").read_text())
BENCH_VARS = yaml.safe_load((ROOT / "roles/bench/vars/main.yml").read_text())
TUNE_SOURCE = (ROOT / "patches/src/sparkllm_lm_head_int8.py").read_text()


@pytest.fixture(scope="module")
def env():
    e = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined)
    e.filters.update(CoreFilters().filters())
    e.filters["default"] = e.filters["d"] = jinja2.filters.do_default  # Ansible's needs its templar
    return e


def test_the_int8_head_is_on_by_default_and_names_its_evidence():
    # The default is the model's (group_vars/all/models.yml): on for the 122B, the default model.
    models = yaml.safe_load((ROOT / "group_vars/all/models.yml").read_text())
    assert models["spark_model_catalogue"][models["model"]]["serve"]["vllm_lm_head_int8"] is True
    text = (ROOT / "group_vars/all/main.yml").read_text()
    line = 'vllm_lm_head_int8: "{{ spark_model_entry.serve.vllm_lm_head_int8 }}"'
    assert yaml.safe_load(text)["vllm_lm_head_int8"] == line.split(": ", 1)[1].strip('"')
    comment = text[:text.index(line)].rsplit("\n\n", 1)[-1]
    for source in ("albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4", "Entrpi/qwen3.5-122B-A10B-on-spark"):
        assert source in comment


def _docker_opts(env, lm_head_int8) -> list[str]:
    """group_vars/all/main.yml always defines vllm_lm_head_int8 (one definition: no fallback in the roles)."""
    ctx = {"serve_container_home": "/root", "serve_container_gpus": "all", "spark_model_dir": "/srv/model",
           "serve_model_path": "/model", "_serve_mount_hf_token": False,
           "serve_flashinfer_jit_verbose": False, "spark_cuda_cache_max_bytes": 4294967296,
           "serve_container_env": {}, "serve_container_extra_args": [], "spark_pytorch_cuda_alloc_conf": ""}
    ctx["vllm_lm_head_int8"] = lm_head_int8
    ctx["_serve_cache_mounts"] = {k: env.from_string(v).render(ctx)
                                  for k, v in SERVE_VARS["_serve_cache_mounts"].items()}
    ctx["_serve_lm_head_tune_dir"] = env.from_string(SERVE_VARS["_serve_lm_head_tune_dir"]).render(ctx)
    return env.from_string(SERVE_VARS["_serve_docker_opts"].strip()).render(ctx)


@pytest.mark.parametrize("value,on", [(True, True), ("true", True), (False, False), ("false", False)])
def test_the_tile_cache_dir_reaches_the_container_with_the_int8_head(env, value, on):
    opts = _docker_opts(env, value)
    want = "--env=SPARKLLM_LM_HEAD_INT8_TUNE_DIR=/root/.cache/vllm/sparkllm-lm-head-int8"
    assert (want in opts) is on
    # inside the vllm cache mount, which the serve role persists on the host (serve_cache_dir/vllm)
    assert SERVE_VARS["_serve_cache_mounts"]["vllm"] == "{{ serve_container_home }}/.cache/vllm"
    # the name the module reads
    assert 'TUNE_DIR_ENV = "SPARKLLM_LM_HEAD_INT8_TUNE_DIR"' in TUNE_SOURCE


@pytest.mark.parametrize("value,want", [(True, True), ("True", True), (False, False), ("false", False)])
def test_the_bench_records_the_head_in_the_run_meta(env, value, want):
    assert env.from_string(BENCH_VARS["_bench_meta"]["lm_head_int8"]).render(vllm_lm_head_int8=value) is want
