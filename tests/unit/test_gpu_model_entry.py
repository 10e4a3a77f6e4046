"""tests/gpu/model_entry.py without a GPU: the entry's settings and argv, its overrides, its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

me = pytest.importorskip("tests.gpu.model_entry")  # yaml, numpy: both in the test venv
from spark_methods import SETTING_DEFAULTS, spark_serve_argv  # noqa: E402

from tests.gpu import e2e  # noqa: E402

NAME = "qwen3.6-35b-a3b-fp8"


@pytest.fixture(scope="module")
def entry() -> dict:
    return me.load_entry(NAME)


def words_after(argv: list[str], option: str) -> str:
    assert option in argv, option
    return argv[argv.index(option) + 1]


@pytest.mark.parametrize("method", me.METHODS)
def test_argv_carries_the_entrys_flags_and_the_host_flags(entry: dict, method: str) -> None:
    r = me.render(entry, method, "/w/pair/fp8", fastsafetensors=True)
    argv = r["argv"]
    assert argv[0] == "/w/pair/fp8"
    assert me.has_run(argv, ["--kv-cache-dtype", "fp8"])  # the entry's extra_args
    assert words_after(argv, "--reasoning-parser") == entry["serve"]["vllm_reasoning_parser"] == "qwen3"
    assert words_after(argv, "--tool-call-parser") == entry["serve"]["vllm_tool_call_parser"] == "qwen3_coder"
    assert words_after(argv, "--load-format") == "fastsafetensors"  # importable: the entry's own value
    # the entry's extra_args first, then the host's flags, all through vllm_serve_extra_args
    host = e2e.HOST_SETTINGS["vllm_serve_extra_args"]
    assert r["settings"]["vllm_serve_extra_args"] == [*entry["extra_args"], *host]
    assert argv[-len(host):] == host
    assert words_after(argv, "--attention-backend") == "FLASH_ATTN"
    spec = json.loads(words_after(argv, "--speculative-config")) if method == "mtp" else None
    if method == "mtp":
        assert spec == {"method": "mtp", "num_speculative_tokens": 2}
        assert "--no-enable-prefix-caching" in argv  # the mtp catalogue's choice, not overridden
    else:
        assert "--speculative-config" not in argv
    assert r["env"] == {}  # vllm_lm_head_int8 false, no server_env
    # the argv is the deploy filter's own rendering of the settings
    assert argv == spark_serve_argv(r["settings"], e2e.load_catalogue())


def test_every_override_is_recorded_with_the_entrys_value_and_a_reason(entry: dict) -> None:
    r = me.render(entry, "mtp", "/w/pair/fp8", fastsafetensors=True)
    ov = r["overrides"]
    assert set(ov) == {"vllm_model_path", "vllm_port", "vllm_served_model_name", "vllm_max_model_len",
                       "vllm_gpu_memory_utilization", "vllm_attention_backend"}
    assert ov["vllm_served_model_name"] == {"entry": "qwen3.6-35b-a3b", "used": "tiny",
                                            "why": ov["vllm_served_model_name"]["why"]}
    assert ov["vllm_max_model_len"]["entry"] == 65536 and ov["vllm_max_model_len"]["used"] == 2048
    assert all(o["why"] for o in ov.values())
    # a setting nobody overrode keeps the entry's value, every other one the main.yml default
    for name, value in entry["serve"].items():
        if name not in ov:
            assert r["settings"][name] == value
    rendered_here = {"spec_method", "vllm_serve_extra_args"}
    for name in set(SETTING_DEFAULTS) - set(entry["serve"]) - set(ov) - rendered_here:
        assert r["settings"][name] == SETTING_DEFAULTS[name], name
    argv = r["argv"]
    assert words_after(argv, "--served-model-name") == "tiny"
    assert words_after(argv, "--max-model-len") == "2048"
    assert words_after(argv, "--port") == str(me.PORTS["mtp"])


def test_fastsafetensors_missing_is_an_override_with_its_reason(entry: dict) -> None:
    r = me.render(entry, "baseline", "/m", fastsafetensors=False)
    assert r["overrides"]["vllm_load_format"]["entry"] == "fastsafetensors"
    assert "not importable" in r["overrides"]["vllm_load_format"]["why"]
    assert words_after(r["argv"], "--load-format") == "safetensors"


def test_the_server_runs_the_rendered_argv(entry: dict, tmp_path: Path) -> None:
    r = me.render(entry, "mtp", "/w/pair/fp8", fastsafetensors=False)
    s = me.EntryServer("mtp", r, "/site", tmp_path)  # built, not started
    assert s.argv == r["argv"] and s.port == me.PORTS["mtp"] and s.method == "mtp"
    assert s.env["PYTHONPATH"] == "/site" and all(s.env[k] == v for k, v in e2e.HOST_ENV.items())


def test_unknown_model_exits_2_naming_the_entries(tmp_path: Path, capsys) -> None:
    assert me.main(["--out", str(tmp_path / "out"), "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and NAME in err and "qwen3.5-122b-hybrid" in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_an_assembled_entry_is_refused_with_exit_2(tmp_path: Path, capsys) -> None:
    assert me.main(["--out", str(tmp_path / "out"), "--model", "qwen3.5-122b-hybrid"]) == 2
    assert "assembly: none" in capsys.readouterr().err


def test_entry_checks(tmp_path: Path) -> None:
    cat = {"spark_model_catalogue": {
        "plain": {"assembly": "none", "methods": {"baseline": {}}, "serve": {}},
        "odd": {"assembly": "none", "methods": {"baseline": {}, "mtp": {}}, "serve": {"vllm_nonsense": 1}}}}
    path = tmp_path / "models.yml"
    path.write_text(yaml.safe_dump(cat))
    with pytest.raises(me.Usage, match=r"methods \['mtp'\]"):
        me.load_entry("plain", path)
    with pytest.raises(me.Usage, match="vllm_nonsense"):
        me.render(me.load_entry("odd", path), "mtp", "/m", True)


def test_has_run_needs_the_words_together() -> None:
    assert me.has_run(["a", "--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8"])
    assert not me.has_run(["--kv-cache-dtype", "auto", "fp8"], ["--kv-cache-dtype", "fp8"])
    assert me.has_run(["x"], [])


def test_make_gpu_model_runs_this_script() -> None:
    import make_run

    argv = make_run.build_argv("gpu-model", {"ARGS": "--model qwen3.6-35b-a3b-fp8 --budget 400"})
    assert argv[1:] == ["tests/gpu/model_entry.py", "--out", "results/gpu-model", "--model",
                        "qwen3.6-35b-a3b-fp8", "--budget", "400"]
    makefile = (Path(me.ROOT) / "Makefile").read_text()
    assert 'gpu-model:\n\t"$$PYTHON" scripts/make_run.py gpu-model\n' in makefile
