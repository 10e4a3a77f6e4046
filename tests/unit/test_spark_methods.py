"""Unit tests for filter_plugins/spark_methods.py against the real catalogue in methods.yml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from spark_methods import (
    SETTING_DEFAULTS,
    CatalogueError,
    FilterModule,
    spark_method_settings_errors,
    spark_method_variant,
    spark_prefix_caching,
    spark_serve_argv,
    spark_speculative_config,
)

ROOT = Path(__file__).resolve().parents[2]
GROUP_VARS = ROOT / "group_vars" / "all"
METHODS = ("baseline", "ngram", "mtp", "eagle3", "dflash")


@pytest.fixture(scope="module")
def methods_yml():
    return yaml.safe_load((GROUP_VARS / "methods.yml").read_text())


@pytest.fixture(scope="module")
def catalogue(methods_yml):
    return methods_yml["spark_method_catalogue"]


@pytest.fixture(scope="module")
def main_yml():
    """main.yml's knobs as Ansible resolves them by default (a model-read default: the default model's)."""
    import spark_methods

    return spark_methods.main_yml_defaults()


def settings(**overrides):
    base = dict(SETTING_DEFAULTS)
    base["spec_eagle3_drafter"] = "/drafters/eagle3"
    base.update(overrides)
    return base


def opt(argv, name):
    """Value following option `name` in argv (AssertionError if absent)."""
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


# --- the catalogue and defaults --------------------------------------------------------------

def test_catalogue_has_exactly_the_five_methods(catalogue):
    assert tuple(catalogue) == METHODS


def test_every_method_names_an_existing_variant(methods_yml, catalogue):
    variants = methods_yml["spark_vllm_variants"]
    keys = ("ref", "extra_prs", "version")
    assert {k: variants["v0_19_1"][k] for k in keys} == {
        "ref": "v0.19.1", "version": "0.19.1",
        # PR 38325 (swapAB block-FP8 GEMM on SM12x) as the diff of its main commit; contract-tested against
        # 0.19.1's source in tests/contract/test_upstream_pr_diffs_contract.py
        "extra_prs": [{"pr": 38325, "sha": "580090db6bcbb95ca9413ccf2d4d6726e6e69799",
                       "diff_sha256": "ea5754e13ab02b1ffa160302be893d78cc236de56d076fe88c4a3a004e3ded61",
                       "rewrite": [["csrc/libtorch_stable/", "csrc/"],
                                   ["torch::stable::Tensor", "torch::Tensor"]]}]}
    assert {k: variants["v0_26_dflash"][k] for k in keys} == {"ref": "v0.26.0", "extra_prs": [],
                                                              "version": "0.26.0"}
    for method, entry in catalogue.items():
        assert entry["vllm_variant"] in variants
        assert entry["description"]
        assert set(entry) >= {"speculative_config", "serve_flags", "requires", "setting_overrides"}
        expected = "v0_26_dflash" if method == "dflash" else "v0_19_1"
        assert spark_method_variant(method, catalogue, variants)["name"] == expected
        # every knob a method reads exists in main.yml
        for knob in list(entry["setting_overrides"].values()) + list(entry["requires"]):
            assert knob in SETTING_DEFAULTS


def test_method_variant_errors(methods_yml, catalogue):
    with pytest.raises(ValueError, match="baseline, ngram, mtp, eagle3, dflash"):
        spark_method_variant("bogus", catalogue, methods_yml["spark_vllm_variants"])
    with pytest.raises(CatalogueError, match="v0_26_dflash"):
        spark_method_variant("dflash", catalogue, {"v0_19_1": {}})


def test_plugin_defaults_are_read_from_main_yml(main_yml, tmp_path):
    """The filter's knobs and defaults are main.yml itself (plus the role-supplied settings), not a copy:
    a knob added to main.yml is a setting with its default, and a name in both places is refused."""
    import spark_methods

    assert {k: SETTING_DEFAULTS[k] for k in main_yml} == main_yml
    assert set(SETTING_DEFAULTS) == set(main_yml) | set(spark_methods.ROLE_SETTING_DEFAULTS)
    grown = tmp_path / "main.yml"
    grown.write_text((GROUP_VARS / "main.yml").read_text() + "# a new knob\nvllm_new_knob: 7\n")
    assert spark_methods._load_knob_defaults(grown)["vllm_new_knob"] == 7
    twice = tmp_path / "twice.yml"
    twice.write_text((GROUP_VARS / "main.yml").read_text() + "vllm_model_path: /m\n")
    with pytest.raises(CatalogueError, match="vllm_model_path"):
        spark_methods._load_knob_defaults(twice)


def test_serve_role_builds_its_settings_with_the_one_builder():
    """roles/serve hands the host's variables to spark_settings (no list of names of its own that a
    new knob could be missing from)."""
    text = (ROOT / "roles" / "serve" / "vars" / "main.yml").read_text()
    serve_vars = yaml.safe_load(text)
    assert "_serve_knob_names" not in serve_vars
    assert serve_vars["_serve_settings"].strip().startswith("{{ hostvars[inventory_hostname]")
    assert "| spark_settings(" in serve_vars["_serve_settings"]


def test_every_main_yml_knob_has_a_comment():
    lines = (GROUP_VARS / "main.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith(("#", " ", "-")):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


def test_defaults_are_valid(catalogue, main_yml):
    assert spark_method_settings_errors(dict(main_yml), catalogue) == []
    assert spark_method_settings_errors({}, catalogue) == []


def test_filter_module_registers_filters():
    filters = FilterModule().filters()
    assert filters["spark_serve_argv"] is spark_serve_argv
    assert filters["spark_speculative_config"] is spark_speculative_config
    assert filters["spark_method_settings_errors"] is spark_method_settings_errors
    assert filters["spark_prefix_caching"] is spark_prefix_caching


# --- speculative config per method -------------------------------------------------------------

@pytest.mark.parametrize(("method", "expected"), [
    ("baseline", None),
    ("ngram", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
               "prompt_lookup_max": 5}),
    ("mtp", {"method": "mtp", "num_speculative_tokens": 2}),
    ("eagle3", {"method": "eagle3", "model": "/drafters/eagle3", "num_speculative_tokens": 3}),
    ("dflash", {"method": "dflash", "model": "z-lab/Qwen3.5-122B-A10B-DFlash",
                "revision": "6c7242c934a9870d7c59c05240bdbb2467cc1394",
                "num_speculative_tokens": 6, "attention_backend": "TRITON_ATTN"}),
])
def test_speculative_config_defaults(catalogue, method, expected):
    assert spark_speculative_config(settings(spec_method=method), catalogue) == expected


def test_overrides_apply_to_the_right_method(catalogue):
    s = settings(spec_method="ngram", spec_num_speculative_tokens=3, spec_ngram_lookup_min=1,
                 spec_ngram_lookup_max=4)
    assert spark_speculative_config(s, catalogue) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    # n-gram knobs do not leak into mtp
    s["spec_method"] = "mtp"
    assert spark_speculative_config(s, catalogue) == {"method": "mtp", "num_speculative_tokens": 3}
    s = settings(spec_method="dflash", spec_dflash_drafter="/drafters/dflash")
    assert spark_speculative_config(s, catalogue)["model"] == "/drafters/dflash"


def test_catalogue_is_not_mutated(catalogue):
    before = json.dumps(catalogue, sort_keys=True)
    spark_serve_argv(settings(spec_method="ngram", spec_num_speculative_tokens=7), catalogue)
    spark_serve_argv(settings(spec_method="eagle3"), catalogue)
    assert json.dumps(catalogue, sort_keys=True) == before


def test_unknown_method_raises(catalogue):
    with pytest.raises(ValueError, match="spec_method='bogus'.*baseline, ngram, mtp, eagle3, dflash"):
        spark_speculative_config(settings(spec_method="bogus"), catalogue)


# --- argv ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_argv_common_options(catalogue, method):
    argv = spark_serve_argv(settings(spec_method=method), catalogue)
    assert all(isinstance(a, str) for a in argv)
    assert argv[0] == "/model"
    assert opt(argv, "--served-model-name") == "qwen3.5-122b"
    assert opt(argv, "--host") == "127.0.0.1"
    assert opt(argv, "--port") == "8000"
    assert opt(argv, "--max-model-len") == "262144"
    assert opt(argv, "--gpu-memory-utilization") == "0.8"  # group_vars/all/main.yml
    assert opt(argv, "--reasoning-parser") == "qwen3"
    # prefix caching is always explicit, one way or the other (0.26.0 turns it on for hybrids)
    assert ("--enable-prefix-caching" in argv) != ("--no-enable-prefix-caching" in argv)
    assert "--disable-log-stats" not in argv
    assert not any("api-key" in a or "api_key" in a for a in argv)
    assert "--tensor-parallel-size" not in argv
    assert "--distributed-executor-backend" not in argv


@pytest.mark.parametrize(("method", "backend", "extra"), [
    ("baseline", "FLASHINFER", {}),
    ("ngram", "FLASHINFER", {}),
    ("mtp", "FLASHINFER", {}),
    ("eagle3", "FLASHINFER", {}),
    ("dflash", "FLASH_ATTN", {"--max-num-batched-tokens": "4096"}),
])
def test_argv_method_flags(catalogue, method, backend, extra):
    argv = spark_serve_argv(settings(spec_method=method), catalogue)
    if backend:
        assert opt(argv, "--attention-backend") == backend
    else:
        assert "--attention-backend" not in argv
    for name, value in extra.items():
        assert opt(argv, name) == value
    if method != "dflash":
        assert "--max-num-batched-tokens" not in argv
    spec = spark_speculative_config(settings(spec_method=method), catalogue)
    if spec is None:
        assert "--speculative-config" not in argv
    else:
        assert json.loads(opt(argv, "--speculative-config")) == spec


def test_speculative_json_is_compact_and_sorted(catalogue):
    argv = spark_serve_argv(settings(spec_method="ngram"), catalogue)
    text = opt(argv, "--speculative-config")
    assert text == ('{"method":"ngram","num_speculative_tokens":5,'
                    '"prompt_lookup_max":5,"prompt_lookup_min":2}')
    # same config with keys in another order renders identically
    shuffled = dict(catalogue)
    entry = dict(catalogue["ngram"])
    entry["speculative_config"] = dict(reversed(list(entry["speculative_config"].items())))
    shuffled["ngram"] = entry
    assert spark_serve_argv(settings(spec_method="ngram"), shuffled) == argv


def test_dflash_caps_memory_fraction_but_does_not_raise_it(catalogue):
    argv = spark_serve_argv(settings(spec_method="dflash", vllm_gpu_memory_utilization=0.9), catalogue)
    assert opt(argv, "--gpu-memory-utilization") == "0.85"
    argv = spark_serve_argv(settings(spec_method="dflash", vllm_gpu_memory_utilization=0.7), catalogue)
    assert opt(argv, "--gpu-memory-utilization") == "0.7"
    argv = spark_serve_argv(settings(spec_method="mtp", vllm_gpu_memory_utilization=0.9), catalogue)
    assert opt(argv, "--gpu-memory-utilization") == "0.9"


def test_argv_user_options(catalogue):
    argv = spark_serve_argv(settings(
        vllm_host="0.0.0.0", vllm_api_key_file="/etc/spark/api-key", vllm_port=9000,
        vllm_max_model_len=32768, vllm_served_model_name="q", vllm_reasoning_parser="",
        vllm_model_path="/models/x"), catalogue)
    assert argv[0] == "/models/x"
    assert opt(argv, "--host") == "0.0.0.0"
    assert opt(argv, "--port") == "9000"
    assert opt(argv, "--max-model-len") == "32768"
    assert opt(argv, "--served-model-name") == "q"
    assert "--reasoning-parser" not in argv
    assert "/etc/spark/api-key" not in argv


def test_argv_ray_tensor_parallel(catalogue):
    argv = spark_serve_argv(settings(spark_tensor_parallel_size=2, spark_distributed_backend="ray"),
                            catalogue)
    assert opt(argv, "--tensor-parallel-size") == "2"
    assert opt(argv, "--distributed-executor-backend") == "ray"
    assert "--nnodes" not in argv
    assert "--headless" not in argv


@pytest.mark.parametrize(("rank", "headless"), [(0, False), (1, True)])
def test_argv_multinode_mp(catalogue, rank, headless):
    argv = spark_serve_argv(settings(
        spark_tensor_parallel_size=2, spark_distributed_backend="mp", spark_nnodes=2,
        spark_node_rank=rank, spark_master_addr="10.0.0.1", spark_master_port=29501), catalogue)
    assert opt(argv, "--tensor-parallel-size") == "2"
    assert opt(argv, "--distributed-executor-backend") == "mp"
    assert opt(argv, "--nnodes") == "2"
    assert opt(argv, "--node-rank") == str(rank)
    assert opt(argv, "--master-addr") == "10.0.0.1"
    assert opt(argv, "--master-port") == "29501"
    assert ("--headless" in argv) is headless


def test_argv_refuses_invalid_settings(catalogue):
    with pytest.raises(ValueError, match="spec_num_speculative_tokens='2'"):
        spark_serve_argv(settings(spec_num_speculative_tokens="2"), catalogue)


def test_argv_is_deterministic(catalogue):
    for method in METHODS:
        s = settings(spec_method=method)
        assert spark_serve_argv(s, catalogue) == spark_serve_argv(dict(reversed(list(s.items()))), catalogue)


def test_unknown_serve_flag_in_catalogue_is_a_catalogue_error(catalogue):
    broken = dict(catalogue)
    broken["mtp"] = dict(catalogue["mtp"], serve_flags={"attention_backendd": "X"})
    with pytest.raises(CatalogueError, match="attention_backendd"):
        spark_serve_argv(settings(), broken)


# --- validation --------------------------------------------------------------------------------

def one_error(catalogue, **overrides):
    errors = spark_method_settings_errors(settings(**overrides), catalogue)
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_valid_with_defaults(catalogue, method):
    assert spark_method_settings_errors(settings(spec_method=method), catalogue) == []


@pytest.mark.parametrize("bad", ["bogus", "", None, "MTP", 3])
def test_bad_method_names_valid_ones(catalogue, bad):
    msg = one_error(catalogue, spec_method=bad)
    assert f"spec_method={bad!r}" in msg
    assert "baseline, ngram, mtp, eagle3, dflash" in msg


@pytest.mark.parametrize(("bad", "fragment"), [
    ("2", "is not an integer (a string"),
    (True, "is not an integer"),
    (2.0, "is not an integer"),
    (0, "out of range"),
    (17, "out of range"),
    (-1, "out of range"),
])
def test_num_speculative_tokens(catalogue, bad, fragment):
    msg = one_error(catalogue, spec_num_speculative_tokens=bad)
    assert f"spec_num_speculative_tokens={bad!r}" in msg
    assert fragment in msg
    assert "between 1 and 16" in msg


def test_string_hint_tells_how_to_pass_json(catalogue):
    msg = one_error(catalogue, spec_num_speculative_tokens="2")
    assert """-e '{"spec_num_speculative_tokens": 2}'""" in msg


@pytest.mark.parametrize("ok", [1, 16])
def test_num_speculative_tokens_bounds_ok(catalogue, ok):
    assert spark_method_settings_errors(settings(spec_num_speculative_tokens=ok), catalogue) == []


def test_ngram_min_greater_than_max(catalogue):
    msg = one_error(catalogue, spec_method="ngram", spec_ngram_lookup_min=4, spec_ngram_lookup_max=3)
    assert "spec_ngram_lookup_min=4" in msg and "spec_ngram_lookup_max=3" in msg and "<=" in msg
    # against the catalogue default max (5)
    msg = one_error(catalogue, spec_method="ngram", spec_ngram_lookup_min=6)
    assert "spec_ngram_lookup_min=6" in msg and "spec_ngram_lookup_max=5" in msg


@pytest.mark.parametrize(("name", "bad"), [
    ("spec_ngram_lookup_min", 0), ("spec_ngram_lookup_max", 0), ("spec_ngram_lookup_min", "3"),
    ("spec_ngram_lookup_max", False),
])
def test_ngram_lookup_types(catalogue, name, bad):
    msg = one_error(catalogue, spec_method="ngram", **{name: bad})
    assert f"{name}={bad!r}" in msg


@pytest.mark.parametrize("drafter", ["", "   ", None])
def test_eagle3_requires_drafter(catalogue, drafter):
    msg = one_error(catalogue, spec_method="eagle3", spec_eagle3_drafter=drafter)
    assert "spec_eagle3_drafter" in msg and "eagle3" in msg and "set spec_eagle3_drafter" in msg


def test_eagle3_drafter_not_needed_for_other_methods(catalogue):
    assert spark_method_settings_errors(settings(spec_method="mtp", spec_eagle3_drafter=""), catalogue) == []


def test_dflash_drafter_must_not_be_blank(catalogue):
    msg = one_error(catalogue, spec_method="dflash", spec_dflash_drafter="")
    assert "spec_dflash_drafter" in msg


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 0.96, 1, 1.5, "0.9", True, None, float("nan")])
def test_gpu_memory_fraction(catalogue, bad):
    msg = one_error(catalogue, vllm_gpu_memory_utilization=bad)
    assert "vllm_gpu_memory_utilization=" in msg and "(0, 0.95]" in msg


@pytest.mark.parametrize("ok", [0.95, 0.9, 0.5, 0.01])
def test_gpu_memory_fraction_ok(catalogue, ok):
    assert spark_method_settings_errors(settings(vllm_gpu_memory_utilization=ok), catalogue) == []


@pytest.mark.parametrize(("name", "bad"), [
    ("vllm_max_model_len", 0), ("vllm_max_model_len", "262144"), ("vllm_max_model_len", -5),
    ("vllm_port", 0), ("vllm_port", 65536), ("vllm_port", "8000"), ("vllm_port", True),
    ("spark_tensor_parallel_size", 0), ("spark_tensor_parallel_size", "2"),
    ("spark_tensor_parallel_size", 1.0),
])
def test_int_knobs(catalogue, name, bad):
    msg = one_error(catalogue, **{name: bad})
    assert f"{name}={bad!r}" in msg and f"set {name}" in msg


def test_a_context_longer_than_the_model_is_refused_at_validation(catalogue):
    # vLLM refuses it only at the serve stage, after the build and download (issue 46, 11)
    msg = one_error(catalogue, vllm_max_model_len=10_000_000)
    assert "vllm_max_model_len=10000000 is above 262144" in msg and "max_position_embeddings" in msg
    assert spark_method_settings_errors(settings(vllm_max_model_len=262144), catalogue) == []
    # a RoPE-scaling override is the one way past it: left to vLLM
    assert spark_method_settings_errors(settings(
        vllm_max_model_len=1_010_000,
        vllm_serve_extra_args=["--hf-overrides", '{"rope_scaling": {"rope_type": "yarn", "factor": 4}}']),
        catalogue) == []


@pytest.mark.parametrize("bad", ["nccl", "Ray", 1, True])
def test_bad_backend(catalogue, bad):
    msg = one_error(catalogue, spark_distributed_backend=bad)
    assert f"spark_distributed_backend={bad!r}" in msg and "'ray' or 'mp'" in msg


@pytest.mark.parametrize("ok", [None, "", "ray", "mp"])
def test_good_backend(catalogue, ok):
    assert spark_method_settings_errors(settings(spark_distributed_backend=ok), catalogue) == []


def test_multinode_needs_mp_and_master(catalogue):
    errors = spark_method_settings_errors(
        settings(spark_nnodes=2, spark_distributed_backend="ray", spark_tensor_parallel_size=2), catalogue)
    assert any("spark_nnodes=2 needs spark_distributed_backend='mp'" in e for e in errors)
    assert any("spark_master_addr" in e for e in errors)
    msg = one_error(catalogue, spark_nnodes=2, spark_distributed_backend="mp", spark_node_rank=2,
                    spark_master_addr="10.0.0.1", spark_tensor_parallel_size=2)
    assert "spark_node_rank=2" in msg
    msg = one_error(catalogue, spark_nnodes=2, spark_distributed_backend="mp",
                    spark_master_addr="10.0.0.1", spark_tensor_parallel_size=3)
    assert "spark_tensor_parallel_size=3" in msg


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "::", "spark.local"])
def test_public_bind_needs_key_or_opt_out(catalogue, host):
    msg = one_error(catalogue, vllm_host=host)
    assert f"vllm_host={host!r}" in msg
    assert "vllm_api_key_file" in msg and "vllm_allow_unauthenticated_bind" in msg
    assert spark_method_settings_errors(settings(vllm_host=host, vllm_api_key_file="/etc/k"), catalogue) == []
    assert spark_method_settings_errors(
        settings(vllm_host=host, vllm_allow_unauthenticated_bind=True), catalogue) == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_needs_no_key(catalogue, host):
    assert spark_method_settings_errors(settings(vllm_host=host), catalogue) == []


def test_opt_out_must_be_boolean(catalogue):
    errors = spark_method_settings_errors(
        settings(vllm_host="0.0.0.0", vllm_allow_unauthenticated_bind="true"), catalogue)
    assert any("vllm_allow_unauthenticated_bind='true' is not a boolean" in e for e in errors)
    # a string "true" does not count as opting out
    assert any("vllm_host='0.0.0.0'" in e for e in errors)


def test_relative_key_file_and_model_dir(catalogue):
    msg = one_error(catalogue, vllm_api_key_file="key.txt")
    assert "vllm_api_key_file='key.txt'" in msg and "absolute" in msg
    msg = one_error(catalogue, spark_model_dir="models/x")
    assert "spark_model_dir='models/x'" in msg


def test_several_errors_reported_together(catalogue):
    errors = spark_method_settings_errors(
        settings(spec_method="eagle3", spec_eagle3_drafter="", vllm_port=0, vllm_gpu_memory_utilization=2),
        catalogue)
    assert len(errors) == 3


def test_non_mapping_inputs(catalogue):
    assert spark_method_settings_errors(None, catalogue)
    assert "methods.yml" in spark_method_settings_errors(settings(), {})[0]


def test_spark_settings_picks_known_names_only(catalogue):
    from spark_methods import spark_settings

    hostvars = {"spec_method": "ngram", "vllm_port": 9000, "inventory_hostname": "spark", "ansible_x": 1}
    picked = spark_settings(hostvars)
    assert picked == {"spec_method": "ngram", "vllm_port": 9000}
    assert "spark_settings" in FilterModule().filters()
    assert opt(spark_serve_argv(picked, catalogue), "--port") == "9000"


# ---- vllm_serve_extra_args: the owner's own flags, appended and checked


def test_extra_args_are_appended_in_order(catalogue):
    extra = ["--enforce-eager", "--seed", "8", "--moe-backend=triton"]
    base = spark_serve_argv(settings(spec_method="mtp"), catalogue)
    argv = spark_serve_argv(settings(spec_method="mtp", vllm_serve_extra_args=extra), catalogue)
    assert argv == base + extra


def test_extra_args_default_is_empty(catalogue):
    assert spark_serve_argv(settings(), catalogue) == spark_serve_argv(
        settings(vllm_serve_extra_args=[]), catalogue)


@pytest.mark.parametrize("bad, fragment", [
    ("--enforce-eager", "is not a list"),
    ({"a": 1}, "is not a list"),
    ([8], "must be a non-empty string"),
    ([""], "must be a non-empty string"),
    (["--port", "9000"], "vllm_port"),
    (["--max_model_len=4096"], "vllm_max_model_len"),
    (["--speculative-config", "{}"], "spec_method"),
    (["--api-key", "secret"], "never in argv"),
    (["--enable-prefix-caching"], "vllm_enable_prefix_caching"),
    (["--no-enable-prefix-caching"], "vllm_enable_prefix_caching"),
    (["--enable-auto-tool-choice"], "vllm_enable_auto_tool_choice"),
    (["--tool-call-parser", "hermes"], "vllm_tool_call_parser"),
    (["--tool_call_parser=hermes"], "vllm_tool_call_parser"),
    (["--max-num-seqs", "8"], "vllm_max_num_seqs"),
    (["--load-format=safetensors"], "vllm_load_format"),
    (["--attention-backend", "FLASH_ATTN"], "serve_flags in methods.yml"),
])
def test_extra_args_refused_with_the_fix(catalogue, bad, fragment):
    errors = spark_method_settings_errors(settings(vllm_serve_extra_args=bad), catalogue)
    assert len(errors) == 1 and fragment in errors[0] and "vllm_serve_extra_args" in errors[0], errors
    with pytest.raises(ValueError, match="vllm_serve_extra_args"):
        spark_serve_argv(settings(vllm_serve_extra_args=bad), catalogue)


def test_extra_args_string_gets_the_json_hint(catalogue):
    (error,) = spark_method_settings_errors(settings(vllm_serve_extra_args="--enforce-eager"), catalogue)
    assert "-e '{" in error


def test_attention_backend_override_applies_to_every_method(catalogue):
    for method in METHODS:
        argv = spark_serve_argv(settings(spec_method=method, vllm_attention_backend="TRITON_ATTN"), catalogue)
        assert opt(argv, "--attention-backend") == "TRITON_ATTN"
        assert argv.count("--attention-backend") == 1
    default = spark_serve_argv(settings(spec_method="mtp"), catalogue)
    assert opt(default, "--attention-backend") == "FLASHINFER"


@pytest.mark.parametrize("bad", ["flash attn", 3, "FLASH;rm"])
def test_attention_backend_override_refuses_non_names(catalogue, bad):
    (error,) = spark_method_settings_errors(settings(vllm_attention_backend=bad), catalogue)
    assert "vllm_attention_backend" in error and "FLASH_ATTN" in error


# ---- attention backend: catalogue per method, every-method and per-method overrides


def test_catalogue_backends_flashinfer_except_dflash(catalogue):
    for method in METHODS:
        expected = "FLASH_ATTN" if method == "dflash" else "FLASHINFER"
        assert catalogue[method]["serve_flags"]["attention_backend"] == expected, method


def test_per_method_backend_overrides_the_rest(catalogue):
    def backend(s, method):
        return opt(spark_serve_argv(dict(s, spec_method=method), catalogue), "--attention-backend")

    s = settings(vllm_attention_backend="TRITON_ATTN", vllm_attention_backends={"dflash": "FLASHINFER"})
    assert backend(s, "dflash") == "FLASHINFER"
    assert backend(s, "mtp") == "TRITON_ATTN"
    s = settings(vllm_attention_backends={"baseline": "FLASH_ATTN"})
    assert backend(s, "baseline") == "FLASH_ATTN"
    assert backend(s, "ngram") == "FLASHINFER"
    argv = spark_serve_argv(dict(s, spec_method="baseline"), catalogue)
    assert argv.count("--attention-backend") == 1


@pytest.mark.parametrize(("bad", "fragment"), [
    ({"bogus": "FLASHINFER"}, "'bogus', which is not a known method"),
    ({"mtp": "flash attn"}, "vllm_attention_backends['mtp']='flash attn' is not a backend name"),
    ({"mtp": ""}, "is not a backend name"),
    ('{"mtp": "FLASHINFER"}', "-e '{"),
    (["FLASHINFER"], "is not a mapping"),
])
def test_per_method_backend_refused_with_the_fix(catalogue, bad, fragment):
    (error,) = spark_method_settings_errors(settings(vllm_attention_backends=bad), catalogue)
    assert fragment in error and "vllm_attention_backends" in error, error


# ---- tool calling, prefix caching, --max-num-seqs, --load-format


def test_tool_calling_on_by_default(catalogue):
    for method in METHODS:
        argv = spark_serve_argv(settings(spec_method=method), catalogue)
        assert "--enable-auto-tool-choice" in argv
        assert opt(argv, "--tool-call-parser") == "qwen3_coder"


def test_tool_calling_off_and_other_parser(catalogue):
    argv = spark_serve_argv(settings(vllm_enable_auto_tool_choice=False), catalogue)
    assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv
    # the parser is irrelevant (not checked) while tool calling is off
    assert spark_method_settings_errors(settings(vllm_enable_auto_tool_choice=False,
                                                 vllm_tool_call_parser=""), catalogue) == []
    argv = spark_serve_argv(settings(vllm_tool_call_parser="hermes"), catalogue)
    assert opt(argv, "--tool-call-parser") == "hermes"


@pytest.mark.parametrize(("overrides", "fragments"), [
    ({"vllm_enable_auto_tool_choice": "false"},
     ["vllm_enable_auto_tool_choice='false' is not a boolean", "-e '{"]),
    ({"vllm_tool_call_parser": ""}, ["vllm_tool_call_parser=''", "qwen3_coder",
                                     "vllm_enable_auto_tool_choice=false"]),
    ({"vllm_tool_call_parser": "qwen3 coder"}, ["is not a parser name"]),
    ({"vllm_tool_call_parser": None}, ["vllm_tool_call_parser=None"]),
    ({"vllm_enable_prefix_caching": 1}, ["vllm_enable_prefix_caching=1 is not true, false or 'auto'"]),
    ({"vllm_enable_prefix_caching": "true"}, ["vllm_enable_prefix_caching='true' is not true", "-e '{"]),
    ({"vllm_enable_prefix_caching": None}, ["vllm_enable_prefix_caching=None", "'auto'"]),
    ({"vllm_max_num_seqs": 0}, ["vllm_max_num_seqs=0 is out of range", ">= 1"]),
    ({"vllm_max_num_seqs": "8"}, ["vllm_max_num_seqs='8' is not an integer", "-e '{"]),
    ({"vllm_load_format": "safetensor"}, ["vllm_load_format='safetensor'", "fastsafetensors"]),
    ({"vllm_load_format": 3}, ["vllm_load_format=3"]),
    ({"vllm_lm_head_int8": "true"}, ["vllm_lm_head_int8='true' is not a boolean", "-e '{"]),
])
def test_serving_feature_knobs_refused_with_the_fix(catalogue, overrides, fragments):
    (error,) = spark_method_settings_errors(settings(**overrides), catalogue)
    for fragment in fragments:
        assert fragment in error, error


def test_lm_head_int8_knob_is_no_argv(catalogue):
    """The INT8 LM head is an environment variable of the container (templates/sparkllm-vllm.env.j2),
    never a vLLM argument: the argv is the same either way."""
    on = spark_serve_argv(settings(vllm_lm_head_int8=True), catalogue)
    assert on == spark_serve_argv(settings(), catalogue)
    assert not [w for w in on if "lm_head" in w.lower() or "int8" in w.lower()]


# Prefix caching by evidence (methods.yml prefix_caching): on for baseline (0.19.1's align mode, no
# speculation), off for every speculative method (corruption reports on hybrids; DFlash's start on 0.26.0).
PREFIX_DEFAULTS = {"baseline": True, "ngram": False, "mtp": False, "eagle3": False, "dflash": False}


def prefix_words(argv):
    return [w for i, w in enumerate(argv) if "prefix-caching" in w or "mamba" in w
            or (i and argv[i - 1] == "--mamba-cache-mode")]


def test_prefix_caching_knob_defaults_to_the_catalogue(main_yml):
    assert main_yml["vllm_enable_prefix_caching"] == "auto"


@pytest.mark.parametrize("method", METHODS)
def test_prefix_caching_auto_takes_each_methods_choice(catalogue, method):
    argv = spark_serve_argv(settings(spec_method=method), catalogue)
    if PREFIX_DEFAULTS[method]:
        assert prefix_words(argv) == ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    else:
        assert prefix_words(argv) == ["--no-enable-prefix-caching"]
    got = spark_prefix_caching(settings(spec_method=method), catalogue)
    assert got == {"enabled": PREFIX_DEFAULTS[method],
                   "mamba_cache_mode": "align" if PREFIX_DEFAULTS[method] else None, "source": "catalogue"}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("forced", [True, False])
def test_prefix_caching_knob_forces_every_method(catalogue, method, forced):
    s = settings(spec_method=method, vllm_enable_prefix_caching=forced)
    argv = spark_serve_argv(s, catalogue)
    # on: always with the hybrid's align mode (Qwen3.5 refuses "all" in 0.19.1 and 0.26.0)
    assert prefix_words(argv) == (["--enable-prefix-caching", "--mamba-cache-mode", "align"] if forced
                                  else ["--no-enable-prefix-caching"])
    assert spark_prefix_caching(s, catalogue)["source"] == "knob"


@pytest.mark.parametrize("bad", [None, {}, {"default": "yes"},
                                 {"default": True, "mamba_cache_mode": "aligned"},
                                 {"default": True, "mamba_cache_mode": "none"}])
def test_malformed_prefix_caching_entry_is_a_catalogue_error(catalogue, bad):
    broken = {**catalogue, "baseline": {**catalogue["baseline"], "prefix_caching": bad}}
    with pytest.raises(CatalogueError, match="prefix_caching must be a mapping"):
        spark_serve_argv(settings(spec_method="baseline"), broken)


def test_mamba_cache_mode_is_managed(catalogue):
    (error,) = spark_method_settings_errors(
        settings(vllm_serve_extra_args=["--mamba-cache-mode=all"]), catalogue)
    assert "repeats an option the toolkit sets itself" in error and "vllm_enable_prefix_caching" in error


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "fastsafetensors", "instanttensor",
                                         "runai_streamer"])
def test_max_num_seqs_and_load_format(catalogue, load_format):
    argv = spark_serve_argv(settings(vllm_max_num_seqs=8, vllm_load_format=load_format), catalogue)
    assert opt(argv, "--max-num-seqs") == "8"
    assert opt(argv, "--load-format") == load_format
    default = spark_serve_argv(settings(), catalogue)
    # one-user default (issue 22): 4 sequences, not vLLM's 1024; null leaves the flag out
    assert opt(default, "--max-num-seqs") == "4" and opt(default, "--load-format") == "fastsafetensors"
    assert "--max-num-seqs" not in spark_serve_argv(settings(vllm_max_num_seqs=None), catalogue)


# ---- spark_bad_driver_enforce_eager: a 590.x driver accepted by preflight serves every method eager


@pytest.mark.parametrize("method", METHODS)
def test_bad_driver_opt_in_serves_every_method_eager(catalogue, method):
    base = settings(spec_method=method)
    assert "--enforce-eager" not in spark_serve_argv(base, catalogue)
    argv = spark_serve_argv(settings(spec_method=method, spark_bad_driver_enforce_eager=True), catalogue)
    assert argv.count("--enforce-eager") == 1
    assert [a for a in argv if a != "--enforce-eager"] == spark_serve_argv(base, catalogue)


@pytest.mark.parametrize("extra", [["--enforce-eager"], ["--no-enforce-eager"], ["--enforce_eager"],
                                   ["--no_enforce_eager=1"]])
def test_extra_args_may_not_repeat_or_undo_the_forced_eager(catalogue, extra):
    errors = spark_method_settings_errors(
        settings(spark_bad_driver_enforce_eager=True, vllm_serve_extra_args=extra), catalogue)
    assert len(errors) == 1, errors
    assert "spark_bad_driver_enforce_eager" in errors[0] and "vllm_serve_extra_args" in errors[0]
    # without the opt-in the owner's own --enforce-eager stays a free choice
    assert spark_method_settings_errors(settings(vllm_serve_extra_args=extra), catalogue) == []


def test_bad_driver_opt_in_must_be_a_boolean(catalogue):
    (error,) = spark_method_settings_errors(settings(spark_bad_driver_enforce_eager="true"), catalogue)
    assert "spark_bad_driver_enforce_eager" in error and "boolean" in error


def test_bad_driver_opt_in_is_a_serve_knob():
    # the serve role hands it to the filter, so its value reaches the argv and the serve fingerprint
    from spark_methods import spark_settings
    picked = spark_settings({"spark_bad_driver_enforce_eager": True})
    assert picked == {"spark_bad_driver_enforce_eager": True}
    assert "spark_bad_driver_enforce_eager" in SETTING_DEFAULTS


# ---- spark_server_env: one environment for the server container and every Ray process


def test_server_env_of_dflash_and_the_int8_head(catalogue):
    from spark_methods import spark_server_env
    assert spark_server_env("dflash", catalogue) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert spark_server_env("mtp", catalogue) == {}
    assert spark_server_env("mtp", catalogue, True) == {"SPARKLLM_LM_HEAD_INT8": "1"}
    assert spark_server_env("dflash", catalogue, True) == {"SPARKLLM_LM_HEAD_INT8": "1",
                                                           "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert spark_server_env("mtp", catalogue, False) == {}


def test_server_env_refuses_values_a_unit_would_misread(catalogue):
    from spark_methods import spark_server_env
    bad = dict(catalogue)
    bad["mtp"] = {**catalogue["mtp"], "server_env": {"VLLM_X": "a b"}}
    with pytest.raises(CatalogueError, match="server_env"):
        spark_server_env("mtp", bad)
    with pytest.raises(ValueError, match="spec_method"):
        spark_server_env("bogus", catalogue)


@pytest.mark.parametrize(("path", "guessed"), [
    ("/tmp/sparkllm-dflash/model", "dflash"), ("/srv/EAGLE3-target", "eagle3"), ("/m/eagle-x", "eagle"),
    ("/m/dspark", "dspark")])
def test_a_target_path_vllm_would_read_as_another_method_is_refused_for_mtp(catalogue, path, guessed):
    # issue 34: 0.26.0 drafts mtp from the target's path and switches the method by its name
    (error,) = spark_method_settings_errors(settings(spec_method="mtp", vllm_model_path=path), catalogue)
    assert error.startswith(f"vllm_model_path={path!r}") and f"would serve {guessed} instead" in error


@pytest.mark.parametrize("method", ["baseline", "ngram", "eagle3", "dflash"])
def test_methods_with_their_own_drafter_or_none_take_any_path(catalogue, method):
    assert not spark_method_settings_errors(
        settings(spec_method=method, vllm_model_path="/tmp/sparkllm-dflash/model",
                 spec_eagle3_drafter="/drafters/e3"), catalogue)


@pytest.mark.parametrize(("value", "ok"), [("", True), ("FLEX_ATTENTION", True), ("flash attn", False),
                                           (3, False)])
def test_the_dflash_drafter_backend_knob_is_a_backend_name(catalogue, value, ok):
    errors = spark_method_settings_errors(
        settings(spec_method="dflash", spec_dflash_attention_backend=value), catalogue)
    assert (not errors) is ok, errors
    if not ok:
        assert errors[0].startswith("spec_dflash_attention_backend=")


def test_the_dflash_drafter_gets_a_non_causal_backend_by_default_and_the_owner_s_when_set(catalogue):
    default = spark_speculative_config(settings(spec_method="dflash"), catalogue)
    assert default["attention_backend"] == "TRITON_ATTN"
    owner = spark_speculative_config(
        settings(spec_method="dflash", spec_dflash_attention_backend="FLEX_ATTENTION"), catalogue)
    assert owner["attention_backend"] == "FLEX_ATTENTION"
    # the target's override never reaches the drafter
    target = spark_speculative_config(
        settings(spec_method="dflash", vllm_attention_backends={"dflash": "FLASHINFER"}), catalogue)
    assert target["attention_backend"] == "TRITON_ATTN"
