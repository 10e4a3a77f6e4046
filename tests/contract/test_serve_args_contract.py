"""The serve arguments our filter renders, checked by the real vLLM's own parser and config classes.

vLLM 0.19.1 (in this interpreter) for every method it serves; the dflash variant's vLLM (0.26.0, its
pure-Python part run from .cache/ in a subprocess of this interpreter) for dflash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spark_methods import (
    LOAD_FORMATS,
    SETTING_DEFAULTS,
    spark_prefix_caching,
    spark_serve_argv,
    spark_speculative_config,
)

from tests.contract import vllm_probe

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]

# Settings cases: (id, overrides). Each is rendered for every method the variant serves.
MAIN_OPTIONS = [
    ("defaults", {}),
    ("public-bind-with-key", {"vllm_host": "0.0.0.0", "vllm_api_key_file": "/etc/spark/api-key",
                              "vllm_port": 9000}),
    ("short-context-mem-090", {"vllm_max_model_len": 32768, "vllm_gpu_memory_utilization": 0.9,
                               "vllm_served_model_name": "other-name", "vllm_model_path": "/models/q"}),
    ("no-reasoning-parser", {"vllm_reasoning_parser": ""}),
    ("extra-args-and-backend", {"vllm_serve_extra_args": ["--enforce-eager", "--seed", "7"],
                                "vllm_attention_backend": "TRITON_ATTN"}),
    ("per-method-backends", {"vllm_attention_backend": "TRITON_ATTN",
                             "vllm_attention_backends": {"baseline": "FLASH_ATTN", "dflash": "FLASHINFER"}}),
    ("tools-off", {"vllm_enable_auto_tool_choice": False}),
    # a 590.x driver accepted by preflight: every method serves eager (no CUDA-graph capture)
    ("bad-driver-eager", {"spark_bad_driver_enforce_eager": True}),
    ("serving-knobs", {"vllm_enable_prefix_caching": True, "vllm_max_num_seqs": 8,
                       "vllm_load_format": "safetensors", "vllm_tool_call_parser": "qwen3_xml"}),
    ("load-format-fastsafetensors", {"vllm_load_format": "fastsafetensors"}),
    ("tokens-override", {"spec_num_speculative_tokens": 4, "spec_ngram_lookup_min": 1,
                         "spec_ngram_lookup_max": 3}),
    ("drafter-revision", {"spec_dflash_drafter_revision": "b" * 40}),
    ("ray-tp2", {"spark_tensor_parallel_size": 2, "spark_distributed_backend": "ray"}),
    ("mp-head", {"spark_tensor_parallel_size": 2, "spark_distributed_backend": "mp", "spark_nnodes": 2,
                 "spark_node_rank": 0, "spark_master_addr": "192.168.100.10", "spark_master_port": 29501}),
    ("mp-worker", {"spark_tensor_parallel_size": 2, "spark_distributed_backend": "mp", "spark_nnodes": 2,
                   "spark_node_rank": 1, "spark_master_addr": "192.168.100.10"}),
]


def settings(**overrides):
    s = dict(SETTING_DEFAULTS)
    s["spec_eagle3_drafter"] = "/drafters/qwen3.5-122b-eagle3"
    s.update(overrides)
    return s


def methods_of(catalogue, variant):
    return [m for m, e in catalogue.items() if e["vllm_variant"] == variant]


def assert_parsed_matches(parsed: dict, s: dict, catalogue: dict, argv: list[str]) -> None:
    method = s["spec_method"]
    flags = catalogue[method]["serve_flags"]
    assert parsed["model_tag"] == s["vllm_model_path"] == parsed["engine_model"]
    assert parsed["served_model_name"] == [s["vllm_served_model_name"]]
    assert parsed["host"] == s["vllm_host"]
    assert parsed["port"] == s["vllm_port"]
    assert parsed["max_model_len"] == s["vllm_max_model_len"]
    expected_mem = min(s["vllm_gpu_memory_utilization"], flags.get("gpu_memory_utilization_cap", 1.0))
    assert parsed["gpu_memory_utilization"] == pytest.approx(expected_mem)
    assert (parsed["reasoning_parser"] or None) == (s["vllm_reasoning_parser"] or None)
    spec = spark_speculative_config(s, catalogue)
    assert parsed["speculative_config"] == spec
    assert parsed["engine_speculative_config"] == spec
    backend = ((s.get("vllm_attention_backends") or {}).get(method) or s.get("vllm_attention_backend")
               or flags.get("attention_backend"))
    assert backend  # every method names its backend (FLASHINFER, FLASH_ATTN for dflash)
    assert parsed["attention_backend"] == backend
    assert parsed["attention_backend_resolved"] == backend, parsed
    extra = s.get("vllm_serve_extra_args") or []
    forced = s["spark_bad_driver_enforce_eager"] is True  # a 590.x driver accepted by preflight
    assert parsed["enforce_eager"] is ("--enforce-eager" in extra or forced)
    if s["vllm_max_num_seqs"] is not None:
        assert parsed["max_num_seqs"] == s["vllm_max_num_seqs"]
    else:
        assert parsed["max_num_seqs"] is None  # vLLM's own default applies
    assert parsed["load_format"] == (s["vllm_load_format"] or "auto")
    assert parsed["load_format_registered"] is True
    assert parsed["max_num_batched_tokens"] == flags.get("max_num_batched_tokens")
    # tool calling: on with a parser this vLLM registers, or off entirely
    assert parsed["enable_auto_tool_choice"] is s["vllm_enable_auto_tool_choice"]
    if s["vllm_enable_auto_tool_choice"]:
        assert parsed["tool_call_parser"] == s["vllm_tool_call_parser"]
        assert parsed["tool_call_parser_registered"] is True, s["vllm_tool_call_parser"]
    else:
        assert parsed["tool_call_parser"] is None
    # stats stay on (speculative metrics), prefix caching as the knob/catalogue say, no key
    assert parsed["disable_log_stats"] is False
    prefix = spark_prefix_caching(s, catalogue)
    assert parsed["enable_prefix_caching"] is prefix["enabled"]
    # on: with the hybrid's align mode; off: vLLM's own "none" (nothing rendered)
    assert parsed["mamba_cache_mode"] == (prefix["mamba_cache_mode"] or "none")
    assert parsed["cache_config"] == "ok", parsed["cache_config"]
    assert parsed["cache_mamba_cache_mode"] == parsed["mamba_cache_mode"]
    assert parsed["api_key"] is None
    assert parsed["tensor_parallel_size"] == s["spark_tensor_parallel_size"]
    assert parsed["distributed_executor_backend"] == (s["spark_distributed_backend"] or None)
    assert parsed["executor_backend_known"] is True
    assert parsed["nnodes"] == s["spark_nnodes"]
    assert parsed["node_rank"] == s["spark_node_rank"]
    assert parsed["headless"] is (s["spark_nnodes"] > 1 and s["spark_node_rank"] > 0)
    if s["spark_nnodes"] > 1:
        assert parsed["master_addr"] == s["spark_master_addr"]
        if s["spark_master_port"] is not None:
            assert parsed["master_port"] == s["spark_master_port"]
    if s["spark_distributed_backend"] == "ray":
        # ParallelConfig accepted everything up to importing Ray (not installed here).
        assert parsed["parallel_config"] == "needs_ray"
    else:
        assert parsed["parallel_config"] == "ok", parsed["parallel_config"]
        assert parsed["parallel_world_size"] == s["spark_tensor_parallel_size"]


# --- vLLM 0.19.1: every method it serves --------------------------------------------------------

def test_contract_environment_is_0_19_1(vllm_module, variants):
    assert vllm_module.__version__ == variants["v0_19_1"]["version"]


@pytest.mark.parametrize(("case", "overrides"), MAIN_OPTIONS, ids=[c for c, _ in MAIN_OPTIONS])
def test_rendered_argv_parses_on_0_19_1(vllm_module, catalogue, case, overrides):
    methods = methods_of(catalogue, "v0_19_1")
    assert set(methods) == {"baseline", "ngram", "mtp", "eagle3"}
    for method in methods:
        s = settings(spec_method=method, **overrides)
        argv = spark_serve_argv(s, catalogue)
        result = vllm_probe.parse_serve(argv)
        assert result["ok"], f"{method}/{case}: vllm serve rejected {argv}: {result.get('stderr')}"
        assert_parsed_matches(result["args"], s, catalogue, argv)


def test_parser_rejects_unknown_flags(vllm_module):
    """Proves the parse check can fail: an unknown flag exits 2 like `vllm serve` does."""
    result = vllm_probe.parse_serve(["/model", "--no-such-flag", "1"])
    assert not result["ok"]
    assert result["exit_code"] == 2
    assert "--no-such-flag" in result["stderr"]


def test_defaults_name_a_backend_tool_parser_and_prefix_choice(vllm_module, catalogue):
    """The default argv of every 0.19.1 method: FlashInfer, Qwen3.5's tool parser, prefix caching on for
    baseline only (align mode), off for the speculative methods (methods.yml prefix_caching)."""
    for method in methods_of(catalogue, "v0_19_1"):
        parsed = vllm_probe.parse_serve(spark_serve_argv(settings(spec_method=method), catalogue))["args"]
        assert parsed["attention_backend_resolved"] == "FLASHINFER", method
        assert parsed["enable_auto_tool_choice"] is True
        assert parsed["tool_call_parser"] == "qwen3_coder"
        assert parsed["enable_prefix_caching"] is (method == "baseline"), method
        assert parsed["mamba_cache_mode"] == ("align" if method == "baseline" else "none"), method


QWEN35_ARCH = "Qwen3_5MoeForConditionalGeneration"  # our checkpoint's (tests/fixtures/make_checkpoints.py)


def test_qwen35_prefix_caching_needs_align_and_an_explicit_flag_on_0_19_1(vllm_module):
    """Why the catalogue renders --mamba-cache-mode align and always states the flag: 0.19.1's registry
    marks Qwen3.5 hybrid without "all"-mode Mamba caching, and hybrids get no prefix caching by default."""
    info = vllm_probe.hybrid_prefix_caching(QWEN35_ARCH)
    assert info == {"ok": True, "is_hybrid": True, "supports_mamba_prefix_caching": False,
                    "hybrid_default_prefix_caching": False}
    assert not vllm_probe.hybrid_prefix_caching("NoSuchForCausalLM")["ok"]  # the check can fail


def test_unknown_mamba_cache_mode_is_refused_by_0_19_1(vllm_module):
    """Proves the cache check can fail: a mode vLLM does not know never reaches the engine."""
    result = vllm_probe.parse_serve(["/model", "--enable-prefix-caching", "--mamba-cache-mode", "aligned"])
    assert not result["ok"] or result["args"]["cache_config"].startswith("error"), result


def test_unregistered_tool_parser_is_caught(vllm_module):
    """Proves the registration check can fail: the parser keeps any string, the API server does not."""
    result = vllm_probe.parse_serve(["/model", "--enable-auto-tool-choice", "--tool-call-parser", "qwen35"])
    assert result["ok"]
    assert result["args"]["tool_call_parser_registered"] is False
    assert "qwen3_coder" in vllm_probe.tool_parsers()


def test_every_load_format_knob_value_is_a_0_19_1_loader(vllm_module):
    assert set(LOAD_FORMATS) <= set(vllm_probe.load_formats())
    assert "safetensor" not in vllm_probe.load_formats()  # the check can fail


# A Qwen3.5 tool call as the model writes it (its chat template's format: XML function/parameter
# tags inside <tool_call>), and the tool the request declared.
QWEN35_TOOL_OUTPUT = ("I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                      "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
EXPECTED_CALL = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]


def tool_call_request(parser: str) -> dict:
    return {"parser": parser, "text": QWEN35_TOOL_OUTPUT, "tools": [WEATHER_TOOL]}


def test_default_tool_parser_reads_qwen35_tool_calls(vllm_module):
    result = vllm_probe.extract_tool_calls(tool_call_request(SETTING_DEFAULTS["vllm_tool_call_parser"]))
    assert result["ok"], result
    assert result["tools_called"] is True
    assert result["calls"] == EXPECTED_CALL


def test_json_tool_parser_does_not_read_qwen35_tool_calls(vllm_module):
    """Proves the format check can fail: hermes (JSON inside <tool_call>) gets no call out of it."""
    result = vllm_probe.extract_tool_calls(tool_call_request("hermes"))
    assert not (result["ok"] and result["calls"] == EXPECTED_CALL), result


def test_bogus_attention_backend_is_caught(vllm_module):
    result = vllm_probe.parse_serve(["/model", "--attention-backend", "FLASHINFERR"])
    assert result["ok"]  # the parser keeps a string ...
    assert "Unknown attention backend" in result["args"]["attention_backend_error"]  # ... vLLM does not


def test_catalogue_methods_are_vllm_methods(vllm_module, catalogue):
    accepted = vllm_probe.speculative_methods()
    for method in methods_of(catalogue, "v0_19_1"):
        spec = catalogue[method]["speculative_config"]
        if spec is not None:
            assert spec["method"] in accepted, method
    assert "dflash" not in accepted  # why dflash needs the 0.20 build


@pytest.mark.parametrize("overrides", [{}, {"spec_num_speculative_tokens": 16}, {"spec_ngram_lookup_min": 5}])
def test_ngram_config_is_fully_built_by_vllm(vllm_module, catalogue, overrides):
    spec = spark_speculative_config(settings(spec_method="ngram", **overrides), catalogue)
    report = vllm_probe.check_speculative(spec)
    assert report["field_errors"] == {}
    assert report["constructed"], report["stage_error"]
    assert report["built"]["method"] == "ngram"
    assert report["built"]["num_speculative_tokens"] == spec["num_speculative_tokens"]
    assert report["built"]["prompt_lookup_min"] == spec["prompt_lookup_min"]
    assert report["built"]["prompt_lookup_max"] == spec["prompt_lookup_max"]


def test_ngram_min_above_max_is_rejected_by_vllm_too(vllm_module):
    """Our validation refuses min > max; so does vLLM (the rule is the same)."""
    report = vllm_probe.check_speculative(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 4, "prompt_lookup_max": 3})
    assert not report["constructed"]
    assert "prompt_lookup_min=4 must be <= prompt_lookup_max=3" in report["stage_error"]


def test_mtp_config_reaches_the_mtp_setup(vllm_module, catalogue):
    spec = spark_speculative_config(settings(spec_method="mtp"), catalogue)
    report = vllm_probe.check_speculative(spec)
    assert report["field_errors"] == {}
    # Every field was accepted; construction stopped where MTP needs the target model's config.
    assert "target_model_config must be present for mtp" in report["stage_error"]


def test_eagle3_config_fields_are_accepted(vllm_module, catalogue):
    spec = spark_speculative_config(settings(spec_method="eagle3"), catalogue)
    report = vllm_probe.check_speculative(spec)
    assert report["field_errors"] == {}
    # Construction reaches the drafter setup, which reads the target model's config (none here).
    assert not report["stage_error"].startswith("ValidationError"), report["stage_error"]
    assert "tokenizer" in report["stage_error"]


def test_bad_speculative_fields_are_caught(vllm_module):
    """Proves the field check can fail: a misspelt key and a zero token count."""
    report = vllm_probe.check_speculative(
        {"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_minimum": 2})
    assert set(report["field_errors"]) == {"num_speculative_tokens", "prompt_lookup_minimum"}


def test_dflash_is_rejected_by_0_19_1(vllm_module, catalogue):
    spec = spark_speculative_config(settings(spec_method="dflash"), catalogue)
    report = vllm_probe.check_speculative(spec)
    assert "method" in report["field_errors"]
    assert report["stage_error"].startswith("ValidationError")
    assert "dflash" in report["stage_error"]


# --- the dflash variant's vLLM (spark_vllm_variants.v0_26_dflash): dflash ---------------------------

def overlay_dir(variants) -> Path:
    version = variants["v0_26_dflash"]["version"]
    return ROOT / ".cache" / f"vllm-{version}-py"


def run_probe_020(variants, requests: list[dict]) -> list[dict]:
    overlay = overlay_dir(variants)
    if not (overlay / ".complete").exists():
        pytest.skip(f"{overlay} is missing: run tests/contract/setup_vllm_env.sh (it fetches the vLLM "
                    f"{variants['v0_26_dflash']['version']} wheel without dependencies)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(CONTRACT_DIR)]))
    proc = subprocess.run(
        [sys.executable, str(CONTRACT_DIR / "vllm_probe.py")], input=json.dumps(requests), env=env,
        capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def dflash_answers(vllm_module, catalogue, variants):
    cases = [settings(spec_method="dflash", **o) for _, o in MAIN_OPTIONS]
    requests = [{"argv": spark_serve_argv(s, catalogue)} for s in cases]
    requests.append({"speculative": spark_speculative_config(cases[0], catalogue)})
    requests.append({"argv": ["/model", "--no-such-flag"]})
    requests.append({"tool_call": tool_call_request(SETTING_DEFAULTS["vllm_tool_call_parser"])})
    # last: the drafter pinned to a commit (issue 15), as the serve role renders it
    requests.append({"speculative": spark_speculative_config(
        settings(spec_method="dflash", spec_dflash_drafter_revision="b" * 40), catalogue)})
    # the owner's drafter backend knob (issue 29): a valid one, then a name vLLM does not know (last two)
    for backend in ("FLEX_ATTENTION", "NO_SUCH_ATTN"):
        requests.append({"speculative": spark_speculative_config(
            settings(spec_method="dflash", spec_dflash_attention_backend=backend), catalogue)})
    answers = run_probe_020(variants, requests)
    return cases, answers


def test_dflash_probe_ran_the_dflash_variants_vllm(dflash_answers, variants):
    _, answers = dflash_answers
    assert answers[0]["vllm_version"] == variants["v0_26_dflash"]["version"]
    assert "dflash" in answers[0]["methods"]


def test_tool_parser_and_load_formats_exist_on_the_dflash_variant(dflash_answers):
    _, answers = dflash_answers
    assert SETTING_DEFAULTS["vllm_tool_call_parser"] in answers[0]["tool_parsers"]
    assert set(LOAD_FORMATS) <= set(answers[0]["load_formats"])
    result = answers[3 + len(MAIN_OPTIONS)]
    assert result["ok"], result
    assert result["calls"] == EXPECTED_CALL


@pytest.mark.parametrize("index", range(len(MAIN_OPTIONS)), ids=[c for c, _ in MAIN_OPTIONS])
def test_dflash_argv_parses_on_the_dflash_variant(dflash_answers, catalogue, index):
    cases, answers = dflash_answers
    result = answers[1 + index]
    assert result["ok"], result.get("stderr")
    assert_parsed_matches(result["args"], cases[index], catalogue, [])
    s = cases[index]
    expected = ((s.get("vllm_attention_backends") or {}).get("dflash") or s.get("vllm_attention_backend")
                or "FLASH_ATTN")
    assert result["args"]["attention_backend"] == expected
    assert result["args"]["max_num_batched_tokens"] == 4096
    assert result["args"]["gpu_memory_utilization"] <= 0.85


def test_dflash_config_fields_accepted_by_the_dflash_variant(dflash_answers):
    _, answers = dflash_answers
    report = answers[1 + len(MAIN_OPTIONS)]
    assert report["field_errors"] == {}
    # Construction reaches the drafter setup, which reads the target model's config (none here).
    assert not report["stage_error"].startswith("ValidationError"), report["stage_error"]


def test_dflash_drafter_attention_backend_is_a_non_causal_backend_of_the_variant(dflash_answers):
    # issue 29: unset, 0.26.0 auto-selects FLASH_ATTN first on SM12x (the FA2 device assert of #50707)
    _, answers = dflash_answers
    report = answers[1 + len(MAIN_OPTIONS)]
    assert report["field_errors"] == {}
    assert report["parsed"]["attention_backend"] == "TRITON_ATTN"
    assert report["attention_backend_non_causal"] is True


def test_dflash_drafter_backend_knob_reaches_the_variants_config(dflash_answers):
    _, answers = dflash_answers
    flex, bogus = answers[-2:]
    assert flex["field_errors"] == {} and flex["parsed"]["attention_backend"] == "FLEX_ATTENTION"
    assert flex["attention_backend_non_causal"] is True
    assert "Unknown attention backend" in bogus["field_errors"]["attention_backend"]


def test_dflash_probe_can_fail(dflash_answers):
    _, answers = dflash_answers
    result = answers[2 + len(MAIN_OPTIONS)]
    assert not result["ok"] and result["exit_code"] == 2


def test_qwen35_prefix_caching_on_the_dflash_variant(vllm_module, catalogue, variants):
    """0.26.0 turns prefix caching ON for hybrids by default and still has no "all" mode for Qwen3.5:
    the catalogue's explicit --no-enable-prefix-caching for dflash is what keeps it off."""
    answers = run_probe_020(variants, [{"hybrid_prefix": QWEN35_ARCH}])
    assert answers[1] == {"ok": True, "is_hybrid": True, "supports_mamba_prefix_caching": False,
                          "hybrid_default_prefix_caching": True}
    assert "--no-enable-prefix-caching" in spark_serve_argv(settings(spec_method="dflash"), catalogue)


# --- the real-GPU run's argv (tests/gpu/e2e.py) on the dflash variant's vLLM --------------------

def test_gpu_e2e_argv_parses_on_the_dflash_variant(vllm_module, catalogue, variants):
    """Every server tests/gpu/e2e.py starts, rendered by spark_serve_argv with the host knobs
    (vllm_attention_backend, vllm_serve_extra_args), is accepted by the dflash variant's own parser."""
    from tests.gpu import e2e

    cases = [settings(spec_method=m, vllm_model_path="/tmp/tiny", vllm_port=8101, **e2e.TEST_OVERRIDES,
                      **e2e.HOST_SETTINGS) for m in ("baseline", "mtp", "ngram")]
    requests = [{"argv": spark_serve_argv(s, catalogue)} for s in cases]
    answers = run_probe_020(variants, requests)
    for s, result in zip(cases, answers[1:], strict=True):
        assert result["ok"], result.get("stderr")
        parsed = result["args"]
        assert parsed["attention_backend"] == "FLASH_ATTN"
        assert parsed["speculative_config"] == spark_speculative_config(s, catalogue)
        assert parsed["gpu_memory_utilization"] == pytest.approx(0.08)


# --- the Hugging Face token file the serve role mounts for methods that download ----------------

@pytest.mark.parametrize("token_path", [True, False])
def test_hub_client_reads_the_token_from_hf_token_path(vllm_module, tmp_path, token_path):
    """roles/serve mounts the 0600 token file and sets HF_TOKEN_PATH (no HF_TOKEN in the container's
    env); the huggingface_hub that vLLM downloads drafters with must read it from there."""
    token_file = tmp_path / "hf_token"
    token_file.write_text("hf_CONTRACTfake0123456789")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "home")  # no token stored there
    if token_path:
        env["HF_TOKEN_PATH"] = str(token_file)
    code = "import huggingface_hub; print(huggingface_hub.get_token())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ("hf_CONTRACTfake0123456789" if token_path else "None")


def test_dflash_drafter_revision_is_a_field_the_dflash_variant_accepts(dflash_answers):
    _, answers = dflash_answers
    report = answers[-3]
    assert report["field_errors"] == {}, report
    assert not report["stage_error"].startswith("ValidationError"), report["stage_error"]


def test_eagle3_drafter_revision_is_accepted_by_0_19_1(vllm_module, catalogue):
    spec = spark_speculative_config(settings(spec_method="eagle3", spec_eagle3_drafter="org/eagle3-drafter",
                                             spec_eagle3_drafter_revision="a" * 40), catalogue)
    assert spec["revision"] == "a" * 40
    report = vllm_probe.check_speculative(spec)
    assert report["field_errors"] == {}
    # a misspelt field name is caught by the same check
    assert "revisoin" in vllm_probe.check_speculative(dict(spec, revisoin="x"))["field_errors"]
