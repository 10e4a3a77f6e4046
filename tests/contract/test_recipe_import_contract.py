"""recipe_import against the real argument parsers of vLLM 0.19.1 (.venv-vllm) and 0.26.0 (its pure-Python
tree, .cache/vllm-0.26.0-py, first on PYTHONPATH of the importer's child process), and the unit tests'
stand-in parser held equal to the real one."""

from __future__ import annotations

from pathlib import Path

import pytest
import recipe_import as ri
from spark_methods import spark_serve_argv
from spark_models import spark_model_entry_errors

from tests.contract import vllm_probe
from tests.unit.test_recipe_import import OPTIONS

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "fixtures" / "recipes"
TREE_026 = ROOT / ".cache" / "vllm-0.26.0-py"
KW = {"image_repo": "sparkllm/vllm"}


def check(release: str):
    if release == "0.26.0":
        if not (TREE_026 / ".complete").exists():
            pytest.skip(f"{TREE_026} is missing: run tests/contract/setup_vllm_env.sh")
        return ri.vllm_check(release, str(TREE_026))
    return ri.vllm_check(release, None)


def run(name: str, release: str):
    path = RECIPES / name
    variant = ri.load_variants()[release]
    return ri.import_recipe(path.read_text(), str(path), check(release), release=release, variant=variant,
                            **KW)


@pytest.fixture(scope="module")
def qwen36_019(vllm_module):
    return run("good-qwen3.6-35b-a3b-fp8-mtp.yaml", "0.19.1")


def test_qwen36_mtp_recipe_imports_on_0_19_1(qwen36_019):
    entry, refusals = qwen36_019
    assert refusals == []
    assert entry["vllm_variant"] == "v0_19_1"
    assert entry["methods"] == {"baseline": {}, "mtp": {}}
    # -tp is the real parser's alias of --tensor-parallel-size; knobs that are the owner's, not the model's
    # (spark_models.SERVE_KEYS), are recorded as the inventory lines to set
    notes = {n["option"]: n["value"] for n in entry["not_applied"]}
    assert list(notes)[:4] == ["--host", "--port", "--max-num-batched-tokens", "--tensor-parallel-size"]
    owners = {"vllm_gpu_memory_utilization", "vllm_enable_prefix_caching", "spec_num_speculative_tokens"}
    assert owners <= set(notes)
    assert not set(notes) & set(entry["serve"])
    assert notes["spec_num_speculative_tokens"] == "2" and notes["vllm_enable_prefix_caching"] == "false"
    methods_yml = ri.load_methods_yml()
    assert spark_model_entry_errors(entry["model_dir"], entry, methods_yml["spark_method_catalogue"],
                                    methods_yml["spark_vllm_variants"]) == []


def test_the_imported_entry_renders_an_argv_0_19_1_accepts(qwen36_019, catalogue):
    """What item 1 will do with the entry: its knobs and extra args through our filter, then vLLM's parser."""
    entry, _ = qwen36_019
    settings = {**entry["serve"], "spec_method": "mtp", "vllm_serve_extra_args": entry["extra_args"]}
    result = vllm_probe.parse_serve(spark_serve_argv(settings, catalogue))
    assert result["ok"], result.get("stderr")
    assert result["args"]["max_model_len"] == entry["serve"]["vllm_max_model_len"]
    assert result["args"]["served_model_name"] == [entry["serve"]["vllm_served_model_name"]]


def test_a_flag_and_a_value_0_19_1_refuses(vllm_module):
    entry, refusals = run("bad-unknown-flag.yaml", "0.19.1")
    assert entry == {}
    assert [(r.line, r.reason.split(":")[0]) for r in refusals] == [(7, "--no-such-flag"),
                                                                   (8, "--max-num-seqs many")]
    assert "invalid int value: 'many'" in refusals[1].reason


@pytest.mark.parametrize(("release", "refused"), [("0.19.1", True), ("0.26.0", False)])
def test_an_option_only_0_26_0_has(vllm_module, release, refused):
    entry, refusals = run("mamba-backend-0.26-only.yaml", release)
    if refused:
        assert [(r.line, "has no such option" in r.reason) for r in refusals] == [(8, True)]
    else:
        assert refusals == []
        assert entry["vllm_variant"] == "v0_26_dflash"
        assert entry["extra_args"] == ["--mamba-backend", "triton"]


def test_qwen36_mtp_recipe_imports_on_0_26_0(vllm_module):
    entry, refusals = run("good-qwen3.6-35b-a3b-fp8-mtp.yaml", "0.26.0")
    assert refusals == []
    assert entry["methods"] == {"baseline": {}, "mtp": {}} and entry["vllm_variant"] == "v0_26_dflash"


def test_a_release_the_interpreter_lacks_is_a_usage_error(vllm_module):
    with pytest.raises(ri.UsageError, match="not 0.26.0"):
        ri.import_recipe("command: vllm serve o/m\n", "r", ri.vllm_check("0.26.0", None), release="0.26.0",
                         variant="v0_26_dflash", **KW)


SAMPLES = {int: "7", float: "0.5", str: "x", "list": "n", "json": '{"method": "ngram"}'}
# options whose parser takes only some names
CHOICES = {"--kv-cache-dtype": "fp8", "--load-format": "safetensors", "--reasoning-parser": "qwen3",
           "--tool-call-parser": "qwen3_coder", "--attention-backend": "FLASHINFER"}


@pytest.mark.parametrize("release", ["0.19.1", "0.26.0"])
def test_the_unit_tests_stand_in_parser_matches_the_real_one(vllm_module, release):
    """Each option of the stand-in table: the real parser knows it, and sets the dest the table says."""
    flags = []
    for option, (_, kind) in OPTIONS.items():
        value = CHOICES.get(option, SAMPLES.get(kind))
        flags.append(ri.Flag([option] + ([value] if value is not None else []), 1))
    answer = check(release)("o/m", flags)
    assert answer.get("version") == release, answer
    for (option, (dest, _)), got in zip(OPTIONS.items(), answer["groups"], strict=True):
        assert got["known"] and got["error"] is None, (option, got)
        assert got["option"] == option
        assert dest in got["changed"], (option, got["changed"])
