"""filter_plugins/spark_bench_knobs.py: every knob the bench stage reads is refused in the validation
play, before the first stage, not hours later in the last one (issue 46, 11)."""

from __future__ import annotations

from pathlib import Path

import pytest
import spark_bench_knobs as bk
import yaml

ROOT = Path(__file__).resolve().parents[2]
OK = {"vllm_max_num_seqs": 4}


def errors(**knobs: object) -> list[str]:
    return bk.spark_bench_errors({**OK, **knobs}, str(ROOT / "playbooks"))


def test_the_defaults_pass() -> None:
    assert errors() == []
    assert errors(bench_concurrency="1,2,4", bench_request_rate="0.5,1", bench_depth="0,8192",
                  bench_goodput="ttft=2000ms,tpot=100ms", bench_temperature=0.6, bench_profile="decode") == []
    assert errors(bench_profile="agent") == []
    assert errors(bench_profile="records", bench_concurrency="1,2") == []


BAD = [
    ({"bench_repeats": 0}, "bench_repeats=0 is out of range (0 passes measure nothing)"),
    ({"bench_request_rate": "1"},
     "bench_request_rate='1' with bench_profile=records: request rates are measured by the decode profile"),
    ({"bench_depth": "0,8192", "bench_profile": "agent"}, "input depths are measured by the decode profile"),
    ({"bench_concurrency": "1,2", "bench_profile": "agent"}, "one conversation at a time"),
    ({"bench_profile": "fast"}, "bench_profile"),
    ({"bench_repeats": "0"}, "bench_repeats=0 is out of range"),  # -e bench_repeats=0: a string
    ({"bench_repeats": "three"}, "bench_repeats"),
    ({"bench_concurrency": "1,,2"}, "bench_concurrency='1,,2' has an empty item"),
    ({"bench_concurrency": "1,x"}, "bench_concurrency='1,x' is not a list of ints"),
    ({"bench_concurrency": "0"}, "bench_concurrency='0': 0 is out of range"),
    ({"bench_concurrency": "2,2"}, "lists a value twice"),
    ({"bench_concurrency": "1,8"}, "level 8 is above vllm_max_num_seqs=4"),
    ({"bench_request_rate": "0,1"}, "bench_request_rate='0,1': 0.0 is out of range"),
    ({"bench_request_rate": "nan"}, "bench_request_rate='nan'"),
    ({"bench_concurrency": "", "bench_request_rate": ""}, "both empty: nothing to measure"),
    ({"bench_depth": "0,,8"}, "bench_depth='0,,8' has an empty item"),
    ({"bench_temperature": -1}, "vLLM refuses a negative temperature"),
    ({"bench_max_tokens": 0}, "bench_max_tokens=0 is out of range"),
    ({"bench_timeout_s": 0}, "bench_timeout_s=0 is out of range"),
    ({"bench_goodput": "ttft=fast"}, "'ttft=fast' is not NAME=TIME"),
    ({"bench_thinking": "maybe"}, "bench_thinking"),
    ({"bench_prompts_file": "/nonexistent/prompts.jsonl"}, "no such file on the controller"),
]


@pytest.mark.parametrize(("knobs", "needle"), BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_knobs_are_named_with_the_fix(knobs: dict, needle: str) -> None:
    errs = errors(**knobs)
    assert errs and any(needle in e for e in errs), errs


def test_an_unwritable_results_dir_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    errs = errors(bench_results_dir=str(blocker / "results"))
    assert len(errs) == 1 and f"bench_results_dir={str(blocker / 'results')!r}" in errs[0], errs
    assert "is not a directory" in errs[0] and "SPARK_RESULTS_DIR" in errs[0]
    assert errors(bench_results_dir=str(tmp_path / "new" / "results")) == []  # can be created: fine
    errs = errors(bench_results_dir=str(blocker))
    assert errs and "exists and is not a directory" in errs[0]


def test_the_default_results_dir_is_checked_where_the_role_puts_it(tmp_path: Path, monkeypatch) -> None:
    defaults = yaml.safe_load((ROOT / "roles" / "bench" / "defaults" / "main.yml").read_text())
    assert defaults["bench_results_dir"] == bk.RESULTS_DIR_DEFAULT  # else the check looks elsewhere
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPARK_RESULTS_DIR", str(blocker))
    errs = bk.spark_bench_errors(OK, str(ROOT / "playbooks"))
    assert errs and str(blocker) in errs[0]
    monkeypatch.delenv("SPARK_RESULTS_DIR")
    assert bk.spark_bench_errors(OK, str(tmp_path / "playbooks")) == []


def test_every_knob_of_the_role_spec_is_type_checked() -> None:
    """A knob another change adds to the spec is checked too: the spec, not a list here, drives it."""
    spec = bk._spec()
    for name, opt in spec.items():
        if opt.get("type") == "int":
            assert errors(**{name: "not-a-number"}), name
        if opt.get("choices"):
            assert errors(**{name: "not-a-choice"}), name

