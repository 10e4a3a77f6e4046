"""The records and agent profiles against the stand-in server's ground truth (its log of every request it
served: tokens, when it took the request and when it wrote the last byte)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sparkllm.bench import cli as bench_cli
from sparkllm.bench import client as bench_client
from sparkllm.bench import records as bench_records
from sparkllm.bench import runner as bench_runner
from sparkllm.bench.prompts import load_prompts

from tests.fixtures.standin_server import Config, StandinServer


def _records_opts(srv: StandinServer, cfg: Config, tmp: Path, **kw) -> bench_runner.RunOptions:
    return bench_runner.RunOptions(
        base_url=srv.base_url, model=cfg.model, label="mtp-k2", out=tmp / "out",
        prompts=bench_records.RECORDS_PROMPTS, repeats=2, profile="records", warmup_pass=True,
        sampling=bench_client.Sampling(max_tokens=64, thinking="default", stream=False),
        sample_interval=0.05, progress=False, **kw)


def test_records_prompts_have_the_records_shapes():
    prompts, _ = load_prompts(bench_records.RECORDS_PROMPTS)
    assert {p.category: p.max_tokens for p in prompts} == {
        "qa": 256, "code": 512, "json": 1024, "math": 64, "long_code": 2048}


def test_records_run_matches_the_servers_truth(tmp_path):
    """e2e tok/s per request = completion tokens / request wall time, as the server saw each request; the
    first pass is discarded; every request is whole (not streamed) with its own token limit; thinking is
    left to the chat template (not sent)."""
    cfg = Config(model="qwen", spec=True, method="mtp", k=2, step_time=0.002, prefill_time=0.03)
    with StandinServer(cfg) as srv:
        doc = bench_runner.execute_run(_records_opts(srv, cfg, tmp_path))
        truth = sorted(srv.truth, key=lambda t: t.request_no)
    assert doc["valid"], doc["problems"]
    assert doc["meta"]["profile"] == "records"
    assert all(not t.streamed for t in truth)
    # warm-up pass (5) + 2 measured passes (10); the measured ones are the last 10 the server served
    assert len(truth) == 15 and len(doc["requests"]) == 10
    measured = truth[-10:]
    limits = {p.id: p.max_tokens for p in load_prompts(bench_records.RECORDS_PROMPTS)[0]}
    by_tokens = sorted(t.tokens for t in measured)
    assert by_tokens == sorted(list(limits.values()) * 2)  # each prompt's own limit reached (stand-in)
    # single stream: the server served the measured requests in the order the client sent them
    for r, t in zip(doc["requests"], measured, strict=True):
        assert r["output_tokens"] == t.tokens
        served_s = t.t_done - t.t_start
        # the client's wall time holds the server's, plus the loopback's few milliseconds (a loose bound
        # for a busy test machine); the figure is tokens over that time
        assert served_s <= r["e2e_s"] < served_s + 0.25
        assert r["e2e_tok_s"] == pytest.approx(t.tokens / r["e2e_s"])
    rec = doc["records"]
    assert rec["passes"] == 2 and len(rec["per_prompt"]) == 5
    assert rec["tok_s_mean"] == pytest.approx(sum(rec["pass_means"]) / 2)
    assert rec["ci95_low"] < rec["tok_s_mean"] < rec["ci95_high"]
    # prefill is inside the figure: a 30 ms prefill on a 64-token answer costs the math prompt visibly
    math = rec["per_prompt"]["records-math"]
    long_code = rec["per_prompt"]["records-long-code"]
    assert math < long_code
    # no TTFT in a whole request, and no decode figure is invented
    assert all(r["ttft_s"] is None and r["decode_tok_s"] is None for r in doc["requests"])
    # acceptance still comes from /metrics
    assert doc["spec"]["mean_acceptance_length"] and doc["spec"]["mean_acceptance_length"] > 1


def test_whole_request_payload_leaves_thinking_to_the_template():
    p = load_prompts(bench_records.RECORDS_PROMPTS)[0][0]
    body = bench_client.build_payload("m", p, bench_client.Sampling(max_tokens=9, thinking="default",
                                                                    stream=False), False)
    assert body["stream"] is False and "stream_options" not in body
    assert "chat_template_kwargs" not in body
    assert body["max_tokens"] == p.max_tokens
    on = bench_client.build_payload("m", p, bench_client.Sampling(thinking="on"), True)
    assert on["chat_template_kwargs"] == {"enable_thinking": True} and on["stream"] is True


def test_agent_turns_share_a_growing_prefix(tmp_path):
    cfg = Config(model="qwen", step_time=0.001, prefill_time=0.002)
    prompts = tmp_path / "agent.jsonl"
    prompts.write_text(json.dumps({"id": "c1", "category": "agent", "max_tokens": 8,
                                   "messages": [{"role": "user", "content": "first question"}],
                                   "followups": ["second", "third"]}) + "\n")
    with StandinServer(cfg) as srv:
        opts = bench_runner.RunOptions(base_url=srv.base_url, model=cfg.model, label="baseline",
                                       out=tmp_path / "out", prompts=prompts, repeats=2, profile="agent",
                                       warmup_pass=True, agent_context_words=50,
                                       sampling=bench_client.Sampling(max_tokens=8), progress=False,
                                       sample_interval=0.05)
        doc = bench_runner.execute_run(opts)
        truth = sorted(srv.truth, key=lambda t: t.request_no)
    assert doc["valid"], doc["problems"]
    reqs = doc["requests"]
    assert [r["turn"] for r in reqs] == [1, 2, 3, 1, 2, 3]
    assert [r["prompt_id"] for r in reqs[:3]] == ["c1#t1", "c1#t2", "c1#t3"]
    # each turn's prompt holds the previous one (its answer and the next question appended)
    toks = [r["prompt_tokens"] for r in reqs]
    assert toks[0] < toks[1] < toks[2] and toks[3] < toks[4]
    assert toks[0] > 50  # the background words are in the first turn
    # one salt per conversation instance: turns share it, passes (and the warm-up) do not
    salts = [t.cache_salt for t in truth[-6:]]
    assert None not in salts and len(set(salts[:3])) == 1 and len(set(salts[3:])) == 1
    assert len({t.cache_salt for t in truth}) == 4  # the probe, the warm-up pass and two measured passes
    ag = doc["agent"]
    assert set(ag["by_turn"]) == {"1", "2", "3"} and ag["ttft_s_first_turn_median"] is not None


def test_agent_turn_failure_ends_the_conversation(tmp_path):
    cfg = Config(model="qwen", step_time=0.001, error_every=3)  # the probe is request 1
    prompts = tmp_path / "agent.jsonl"
    prompts.write_text(json.dumps({"id": "c1", "category": "agent", "messages": [
        {"role": "user", "content": "q"}], "followups": ["a", "b"]}) + "\n")
    with StandinServer(cfg) as srv:
        opts = bench_runner.RunOptions(base_url=srv.base_url, model=cfg.model, label="x", out=tmp_path / "o",
                                       prompts=prompts, repeats=1, profile="agent", warmup_pass=False,
                                       warmup=0, agent_context_words=0, sampling=bench_client.Sampling(4),
                                       progress=False)
        doc = bench_runner.execute_run(opts)
    assert not doc["valid"]
    errs = [r["error"] for r in doc["requests"]]
    assert errs[0] is None and "HTTP 500" in errs[1] and errs[2].startswith("not sent: turn 2 of c1 failed")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--profile", "records", "--request-rate", "1"], "--request-rate does not apply to --profile records"),
    (["--profile", "records", "--warmup", "3"], "--warmup does not apply"),
    (["--profile", "agent", "--concurrency", "2"], "one conversation at a time"),
    (["--profile", "agent", "--depth", "8192"], "--depth does not apply"),
])
def test_profile_refuses_what_it_cannot_measure(tmp_path, capsys, argv, needle):
    rc = bench_cli.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                         "--out", str(tmp_path / "o"), *argv])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_bad_per_prompt_limit_is_named(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"id": "a", "category": "c", "max_tokens": 0,
                               "messages": [{"role": "user", "content": "x"}]}) + "\n")
    rc = bench_cli.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                         "--out", str(tmp_path / "o"), "--profile", "records", "--prompts", str(bad)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "p.jsonl:1" in err and "max_tokens 0 is not a positive integer" in err


def test_cli_records_run_reports_beside_the_records(tmp_path, capsys):
    """`bench.py run --profile records` end to end: its stored figure is the mean of the passes of the
    requests the server timed, and the report sets it beside the published records with the ratio."""
    from sparkllm.bench import report as bench_report

    cfg = Config(model="qwen", spec=True, method="mtp", k=2, step_time=0.001, prefill_time=0.01)
    out = tmp_path / "store"
    with StandinServer(cfg) as srv:
        rc = bench_cli.main(["run", "--base-url", srv.base_url, "--model", "qwen", "--label", "mtp-k2",
                             "--out", str(out), "--profile", "records", "--repeats", "2", "--quiet"])
        truth = sorted(srv.truth, key=lambda t: t.request_no)[-10:]
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(next(out.glob("*.json")).read_text())
    assert doc["meta"]["sampling"]["thinking"] == "default" and doc["meta"]["sampling"]["stream"] is False
    server_passes = [sum(t.e2e_tok_s for t in truth[i::2]) / 5 for i in (0, 1)]  # blocks: prompt x pass
    assert doc["records"]["tok_s_mean"] == pytest.approx(sum(server_passes) / 2, rel=0.25)
    path, stats = bench_report.make_report(out, None, "baseline", False)
    md = path.read_text()
    assert "## Against the public records" in md
    row = next(line for line in md.splitlines() if line.startswith("| mtp-k2 |") and "x |" in line)
    mean = doc["records"]["tok_s_mean"]
    assert f"{mean / 51.58:.2f}x" in row and f"{mean / 59.0:.2f}x" in row
    assert "| albond |" in md and "| Entrpi (best) |" in md
    from sparkllm.bench.analysis import summary_lines
    assert any(line.startswith("records profile mtp-k2:") and "Entrpi 59 tok/s" in line
               for line in summary_lines(stats, "baseline"))


@pytest.mark.parametrize(("argv", "decode"), [
    ([], False), (["--concurrency", "1"], False), (["--concurrency", "1,2"], True),
    (["--request-rate", "0.5"], True), (["--depth", "0,8192"], True), (["--depth", "0"], False),
])
def test_sweep_load_options_measure_with_the_decode_profile(argv, decode):
    """The bench stage's default profile (records) refuses rates and depths: a sweep asking for them (or for
    several load levels) measures with the decode profile."""
    import sweep

    a = sweep.build_parser().parse_args(["--methods", "baseline", *argv])
    assert sweep._needs_decode(a) is decode
