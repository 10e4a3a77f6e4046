"""Every model catalogue entry (group_vars/all/models.yml) and every method it supports, rendered our way and
parsed by the vLLM release that serves it; and what that release's model registry and speculative config say
about the entry's architecture and its MTP head.

The argv is the one the serve role renders: the argv filter's defaults (SETTING_DEFAULTS), the entry's
``serve:`` knobs, ``vllm_serve_extra_args`` = the entry's ``extra_args``, the method, and the method's drafter
where it needs one. The release: the variant the method names in methods.yml, else the entry's
``vllm_variant`` (docs/model-catalogue.md section 1); 0.19.1 is this interpreter's vLLM, another release runs
from its pure-Python tree (.cache/vllm-<version>-py, tests/contract/setup_vllm_env.sh) in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from spark_methods import SETTING_DEFAULTS, spark_serve_argv, spark_speculative_config
from spark_models import DRAFTER_KNOBS, spark_model_entry_errors

from tests.contract import model_catalogue_probe

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]
MODELS = yaml.safe_load((ROOT / "group_vars" / "all" / "models.yml").read_text())["spark_model_catalogue"]

# The checkpoint's architecture, as its config.json states it; the entry does not record it (an
# ``architecture:`` key of the entry wins where models.yml has one). text_config: what the MTP path reads.
ARCHITECTURES = {
    # tests/fixtures/make_checkpoints.py:315-325 writes the 122B's config this way (docs/model-catalogue.md
    # section 3: "the same model class as our 122B")
    "qwen3.5-122b-hybrid": {"architecture": "Qwen3_5MoeForConditionalGeneration", "model_type": "qwen3_5_moe",
                            "text_config": {"mtp_num_hidden_layers": 1}},
    # Qwen/Qwen3.6-35B-A3B-FP8 config.json (docs/model-catalogue.md section 3, with its sources): 40 layers,
    # hidden 2048, 256 experts with 8 routed, one MTP layer
    "qwen3.6-35b-a3b-fp8": {"architecture": "Qwen3_5MoeForConditionalGeneration", "model_type": "qwen3_5_moe",
                            "text_config": {"num_hidden_layers": 40, "hidden_size": 2048, "num_experts": 256,
                                            "num_experts_per_tok": 8, "mtp_num_hidden_layers": 1}},
}
# A drafter for a method that needs one and whose entry names none (eagle3 of the 122B: the owner sets
# spec_eagle3_drafter, main.yml has no default); the path is never opened, only parsed.
PLACEHOLDER_DRAFTER = "/drafters/placeholder-eagle3"


def architecture_of(name: str) -> dict:
    known = dict(ARCHITECTURES[name])
    if MODELS[name].get("architecture"):
        known["architecture"] = MODELS[name]["architecture"]
    return known


def variant_of(entry: dict, method: str, catalogue: dict) -> str:
    return catalogue[method].get("vllm_variant") or entry["vllm_variant"]


def settings_for(entry: dict, method: str) -> dict:
    s = dict(SETTING_DEFAULTS)
    s.update(entry["serve"])
    s["vllm_serve_extra_args"] = list(entry.get("extra_args") or [])
    s["spec_method"] = method
    knob = DRAFTER_KNOBS.get(method)
    if knob:
        spec = entry["methods"][method] or {}
        s[knob] = spec.get("drafter") or s.get(knob) or PLACEHOLDER_DRAFTER
        if spec.get("drafter_revision"):
            s[f"{knob}_revision"] = spec["drafter_revision"]
    return s


def extra_value(extra: list[str], option: str):
    for i, word in enumerate(extra):
        if word == option and i + 1 < len(extra):
            return extra[i + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


CASES = [(name, method) for name, entry in MODELS.items() for method in entry["methods"]]


def run_release(variants: dict, variant: str, requests: list[dict]) -> list[dict]:
    """Answers of model_catalogue_probe for ``requests`` from the release of ``variant``."""
    import vllm

    version = variants[variant]["version"]
    if version == vllm.__version__:
        out = []
        for req in requests:
            if "argv" in req:
                out.append(model_catalogue_probe.serve(req["argv"]))
            else:
                out.append(model_catalogue_probe.architecture(req["architecture"], req["model_type"],
                                                              req["text_config"]))
        return out
    tree = ROOT / ".cache" / f"vllm-{version}-py"
    if not (tree / ".complete").exists():
        pytest.skip(f"{tree} is missing: run tests/contract/setup_vllm_env.sh")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(CONTRACT_DIR)]))
    proc = subprocess.run([sys.executable, str(CONTRACT_DIR / "model_catalogue_probe.py")],
                          input=json.dumps(requests), env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MODEL_PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    answers = json.loads(lines[-1].split(" ", 1)[1])
    assert answers[0]["vllm_version"] == version
    return answers[1:]


@pytest.fixture(scope="module")
def answers(vllm_module, catalogue, variants):
    """(model, method) -> the parse of its argv; (model, variant) -> its architecture's answer."""
    by_variant: dict[str, list[tuple[tuple[str, str], dict]]] = {}
    for name, method in CASES:
        entry = MODELS[name]
        request = {"argv": spark_serve_argv(settings_for(entry, method), catalogue)}
        by_variant.setdefault(variant_of(entry, method, catalogue), []).append(((name, method), request))
    for name, entry in MODELS.items():
        arch = architecture_of(name)
        for variant in {variant_of(entry, m, catalogue) for m in entry["methods"]}:
            by_variant.setdefault(variant, []).append(((name, variant), dict(arch)))
    out = {}
    for variant, items in by_variant.items():
        got = run_release(variants, variant, [req for _, req in items])
        out.update({key: answer for (key, _), answer in zip(items, got, strict=True)})
    return out


def test_every_entry_passes_the_catalogue_check(catalogue, variants):
    for name, entry in MODELS.items():
        assert spark_model_entry_errors(name, entry, catalogue, variants) == [], name
    assert set(ARCHITECTURES) == set(MODELS), "name each new entry's architecture in ARCHITECTURES"


@pytest.mark.parametrize(("model", "method"), CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_the_entry_argv_parses_to_its_values(answers, catalogue, model, method):
    entry = MODELS[model]
    s = settings_for(entry, method)
    result = answers[(model, method)]
    assert result["ok"], f"{model}/{method}: vllm serve rejected it: {result.get('stderr')}"
    args = result["args"]
    serve = entry["serve"]
    assert args["served_model_name"] == [serve["vllm_served_model_name"]]
    assert args["max_model_len"] == serve["vllm_max_model_len"]
    assert (args["reasoning_parser"] or None) == (serve.get("vllm_reasoning_parser") or None)
    assert args["tool_call_parser"] == s["vllm_tool_call_parser"]
    assert args["tool_call_parser_registered"] is True
    assert args["load_format"] == (s["vllm_load_format"] or "auto")
    assert args["load_format_registered"] is True
    # the entry's extra args reach the engine: its KV-cache dtype, accepted by the release's CacheConfig
    assert args["kv_cache_dtype"] == (extra_value(s["vllm_serve_extra_args"], "--kv-cache-dtype") or "auto")
    assert args["kv_cache_dtype_error"] is None
    spec = spark_speculative_config(s, catalogue)
    assert args["speculative_config"] == spec
    assert args["engine_speculative_config"] == spec
    want = (catalogue[method]["speculative_config"] or {}).get("method")
    assert (spec or {}).get("method") == want


def test_the_35b_is_served_with_fp8_kv_and_mtp(answers):
    """The values docs/model-catalogue.md section 3 chose for the 35B, as vLLM 0.19.1 parsed them."""
    args = answers[("qwen3.6-35b-a3b-fp8", "mtp")]["args"]
    assert args["served_model_name"] == ["qwen3.6-35b-a3b"]
    assert args["max_model_len"] == 65536
    assert args["kv_cache_dtype"] == "fp8"
    assert args["speculative_config"]["method"] == "mtp"
    assert args["enable_prefix_caching"] is False  # methods.yml: off for MTP on the Qwen3.5/3.6 hybrids


def test_every_entry_architecture_is_registered_with_its_mtp_head(answers, catalogue):
    """The release's registry knows the class, marks it hybrid, and its MTP override (0.19.1
    vllm/config/speculative.py:324-333, 0.26.0 :505-514) turns qwen3_5_moe into the registered drafter class
    Qwen3_5MoeMTP."""
    for name, entry in MODELS.items():
        for variant in {variant_of(entry, m, catalogue) for m in entry["methods"]}:
            got = answers[(name, variant)]
            assert got["registered"] is True, (name, variant, got)
            assert got["is_hybrid"] is True, (name, variant, got)
            assert got["config_model_type"] == architecture_of(name)["model_type"], (name, variant, got)
            if "mtp" in entry["methods"]:
                assert got["mtp_model_type"] == "qwen3_5_mtp", (name, variant, got)
                assert got["mtp_architectures"] == ["Qwen3_5MoeMTP"], (name, variant, got)
                assert got["mtp_registered"] is True, (name, variant, got)


def test_mtp_aliases_resolve_to_mtp_on_0_19_1(vllm_module):
    """Recipes name Qwen's MTP qwen3_next_mtp or qwen3_5_mtp; 0.19.1 renames both to mtp
    (vllm/config/speculative.py:367-371) and then asks for the target model, as for mtp itself."""
    from tests.contract import vllm_probe

    for alias in ("qwen3_next_mtp", "qwen3_5_mtp", "mtp"):
        report = vllm_probe.check_speculative({"method": alias, "num_speculative_tokens": 2})
        assert report["field_errors"] == {}, alias
        assert "target_model_config must be present for mtp" in report["stage_error"], alias


# --- the checks above can fail ----------------------------------------------------------------------

def test_an_unregistered_architecture_is_reported(vllm_module):
    got = model_catalogue_probe.architecture("NoSuchMoeForConditionalGeneration", "qwen3_5_moe",
                                             {"mtp_num_hidden_layers": 1})
    assert got["registered"] is False
    assert got["is_hybrid"] is None


def test_the_mtp_class_follows_the_model_type(vllm_module):
    """The drafter class comes from the config's model type, not the class name: qwen3_next leads to
    Qwen3NextMTP (0.19.1 vllm/config/speculative.py:308-314), so a wrong model_type would fail above."""
    got = model_catalogue_probe.architecture("Qwen3_5MoeForConditionalGeneration", "qwen3_next", {})
    assert got["registered"] is True
    assert got["mtp_model_type"] == "qwen3_next_mtp"
    assert got["mtp_architectures"] == ["Qwen3NextMTP"]


def test_a_kv_cache_dtype_the_release_lacks_is_refused(vllm_module):
    result = model_catalogue_probe.serve(["/model", "--kv-cache-dtype", "fp9"])
    assert not result["ok"]
    assert result["exit_code"] == 2
