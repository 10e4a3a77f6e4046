"""bench_ceiling: bytes read per generated token from the checkpoint's headers, and the report's ceiling."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import bench
import hybrid_merge
import pytest
from sparkllm.bench import ceiling as bc
from sparkllm.checkpoint.safetensors_io import read_header

from tests.fixtures.make_checkpoints import GenConfig, generate

CFG = GenConfig(layers=4, experts=4, top_k=2)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ceiling")
    pair = generate(root / "src", CFG)
    out = root / "hybrid"
    argv = ["--int4", str(pair.int4_dir), "--fp8", str(pair.fp8_dir), "--out", str(out)]
    assert hybrid_merge.main(argv) == 0
    return out


def header_tensors(d: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({n: (t.dtype, t.shape, t.nbytes) for n, t in read_header(f).tensors.items()})
    return out


def of(d: Path, **kw) -> dict:
    cfg, tensors = bc.load_checkpoint(d)
    return bc.breakdown(cfg, tensors, **kw)


def test_bytes_by_class_equal_the_header_sums(hybrid: Path) -> None:
    t = header_tensors(hybrid)
    text = {n: v for n, v in t.items() if not n.startswith(("mtp.", "model.visual."))}

    def total(pred) -> int:
        return sum(v[2] for n, v in text.items() if pred(n))

    experts = total(lambda n: ".mlp.experts." in n)
    assert experts and any(v[0] == "I32" for n, v in text.items() if ".mlp.experts." in n)  # INT4 packed
    assert {v[0] for n, v in text.items() if ".mlp.shared_expert." in n} == {"F8_E4M3", "F32"}  # hybrid FP8
    b = of(hybrid)["bytes"]
    assert b["routed_experts"] == experts * CFG.top_k / CFG.experts
    assert b["shared_experts"] == total(lambda n: ".mlp.shared_expert." in n)
    assert b["attention"] == total(lambda n: ".self_attn." in n)
    assert b["linear_attention"] == total(lambda n: ".linear_attn." in n)
    assert b["router"] == total(lambda n: ".mlp.gate." in n or ".shared_expert_gate." in n)
    assert b["embedding"] == CFG.hidden * 2  # one BF16 row
    assert b["lm_head"] == t["lm_head.weight"][2] == CFG.vocab * CFG.hidden * 2
    assert b["other"] == 0  # every tensor of the checkpoint has a class
    counted = experts + sum(v[2] for n, v in text.items() if ".mlp.experts." not in n)
    counted -= t["model.language_model.embed_tokens.weight"][2]
    weights = sum(v for k, v in b.items() if k not in ("kv_cache", "linear_state"))
    assert weights == counted - experts + experts * CFG.top_k / CFG.experts + CFG.hidden * 2
    nr = of(hybrid)["not_read"]
    assert nr["mtp"] == sum(v[2] for n, v in t.items() if n.startswith("mtp.")) > 0
    assert nr["visual"] == sum(v[2] for n, v in t.items() if n.startswith("model.visual.")) > 0


def test_int8_head_halves_the_head_plus_a_scale_per_row(hybrid: Path) -> None:
    bf16, int8 = of(hybrid), of(hybrid, lm_head_int8=True)
    assert int8["bytes"]["lm_head"] == bf16["bytes"]["lm_head"] / 2 + 4 * CFG.vocab
    assert int8["bytes_per_token"] == bf16["bytes_per_token"] - bf16["bytes"]["lm_head"] / 2 + 4 * CFG.vocab
    assert int8["ceiling_tok_s"] > bf16["ceiling_tok_s"]


def test_routed_experts_scale_with_top_k(hybrid: Path, tmp_path: Path) -> None:
    cfg, tensors = bc.load_checkpoint(hybrid)
    one = bc.breakdown({**cfg, "num_experts_per_tok": 1}, tensors)
    four = bc.breakdown({**cfg, "num_experts_per_tok": 4}, tensors)
    assert four["bytes"]["routed_experts"] == 4 * one["bytes"]["routed_experts"] > 0
    assert four["not_read"]["routed_experts_not_chosen"] == 0
    assert {k: v for k, v in four["bytes"].items() if k != "routed_experts"} == {
        k: v for k, v in one["bytes"].items() if k != "routed_experts"}


def test_kv_grows_with_the_context_on_full_attention_layers_only(hybrid: Path) -> None:
    at0, at1k = of(hybrid), of(hybrid, context=1000)
    full = CFG.layers // CFG.full_attention_interval
    assert at0["full_attention_layers"] == full and at0["linear_attention_layers"] == CFG.layers - full
    assert at0["bytes"]["kv_cache"] == 0
    assert at1k["bytes"]["kv_cache"] == 1000 * full * 2 * CFG.kv_heads * CFG.head_dim * 2
    assert at1k["ceiling_tok_s"] < at0["ceiling_tok_s"]
    assert bc.with_context(at0, 1000)["bytes_per_token"] == at1k["bytes_per_token"]


def test_linear_state_from_the_config_dims_and_ssm_dtype(hybrid: Path) -> None:
    cfg, tensors = bc.load_checkpoint(hybrid)
    lin = CFG.layers - CFG.layers // CFG.full_attention_interval
    header = bc.breakdown(cfg, tensors)
    # the fixture: k heads 4 x 16, v heads 8 x 16, conv kernel 4, all BF16
    conv = 3 * (2 * 4 * 16 + 8 * 16) * 2
    assert header["bytes"]["linear_state"] == 2 * lin * (conv + 8 * 16 * 16 * 2)
    dims = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32"}
    fp32 = bc.breakdown({**cfg, **dims}, tensors)
    assert fp32["linear_state_dims"] == "config.json"
    assert fp32["bytes"]["linear_state"] == 2 * lin * (conv + 8 * 16 * 16 * 4)


def test_cli_prints_the_breakdown_and_json(hybrid: Path, capsys) -> None:
    assert bench.main(["ceiling", "--model-dir", str(hybrid), "--context", "512", "--bandwidth-gbs", "100",
                       "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["context_tokens"] == 512 and doc["bandwidth_gbs"] == 100
    assert doc["ceiling_tok_s"] == pytest.approx(100e9 / doc["bytes_per_token"])
    assert doc["bandwidth_source"] == "given with --bandwidth-gbs"
    assert bench.main(["ceiling", "--model-dir", str(hybrid), "--lm-head-int8"]) == 0
    out = capsys.readouterr().out
    assert "no-speculation ceiling" in out and "LM head int8" in out


@pytest.mark.parametrize(("damage", "says"), [
    ("missing", "not a directory"),
    ("no-config", "config.json: cannot read it"),
    ("corrupt", "unreadable safetensors header"),
    ("no-tensors", "holds no *.safetensors"),
])
def test_bad_model_dir_is_a_usage_error(hybrid: Path, tmp_path: Path, damage: str, says: str, capsys) -> None:
    d = tmp_path / "m"
    if damage != "missing":
        d.mkdir()
        if damage != "no-config":
            (d / "config.json").write_text((hybrid / "config.json").read_text())
        if damage in ("no-config", "corrupt"):
            shard = sorted(hybrid.glob("model-*.safetensors"))[0]
            (d / shard.name).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" if damage == "corrupt"
                                         else shard.read_bytes())
    assert bench.main(["ceiling", "--model-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert says in err and "--model-dir" in err and "Traceback" not in err


def test_run_refuses_a_bad_model_dir_before_any_request(tmp_path: Path, capsys) -> None:
    rc = bench.main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--label", "x",
                     "--out", str(tmp_path / "res"), "--model-dir", str(tmp_path / "nope")])
    assert rc == 2
    assert "--model-dir" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_attach_uses_the_runs_mean_context(hybrid: Path) -> None:
    base = of(hybrid)
    doc = {"requests": [{"ok": True, "prompt_tokens": 100, "output_tokens": 50},
                        {"ok": True, "prompt_tokens": 300, "output_tokens": 150},
                        {"ok": False, "prompt_tokens": 9999, "output_tokens": 0}]}
    bc.attach(doc, base)
    assert doc["ceiling"]["context_tokens"] == (125 + 375) / 2
    bc.attach(no := {"requests": []}, None)
    assert "ceiling" not in no


def _row(ceiling: float | None, *, acc_len=None, k=None, concurrency=1, decode=40.0, label="row"):
    runs = [SimpleNamespace(doc={"ceiling": {"ceiling_tok_s": ceiling, "bytes_per_token": 5e9,
                                             "context_tokens": 300.0, "bandwidth_gbs": 273.0,
                                             "lm_head": "int8"}} if ceiling else {})]
    return SimpleNamespace(label=label, runs=runs, context=json.dumps({"concurrency": concurrency}),
                           acc_len=acc_len, k=k, decode={"median": decode})


def test_report_rows_compare_with_the_ceiling_and_spec_with_ceiling_times_acceptance() -> None:
    base, spec = _row(50.0, decode=40.0), _row(50.0, acc_len=2.5, k=2, decode=100.0, label="mtp-k2")
    assert bc.row_ceiling(base)["fraction"] == pytest.approx(0.8)
    c = bc.row_ceiling(spec)
    assert c["bound"] == pytest.approx(125.0) and c["fraction"] == pytest.approx(0.8)
    assert bc.row_ceiling(_row(50.0, concurrency=4)) is None  # a batch is not single-stream
    assert bc.row_ceiling(_row(None)) is None
    lines = bc.table_lines([base, spec, _row(None, label="none")])
    assert any("| mtp-k2 |" in x and "| 125.00 |" in x and "80%" in x for x in lines)
    assert not any("| none |" in x for x in lines)
    assert bc.table_lines([_row(None)]) == []
    summary = bc.summary_lines([base, spec])
    assert len(summary) == 2 and "80% of 125.00 tok/s (50.00 x 2.50 mean acceptance length" in summary[1]


def test_run_stores_the_ceiling_and_the_report_shows_it(hybrid: Path, tmp_path: Path) -> None:
    from tests.fixtures.standin_server import Config, StandinServer
    from tests.unit.bench_helpers import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "out"
    meta = {"lm_head_int8": True, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    with StandinServer(Config(spec=True, k=2, step_time=0.002, model="qwen")) as srv:
        rc = bench.main(["run", "--base-url", srv.base_url, "--model", "qwen", "--label", "mtp-k2",
                         "--out", str(out), "--prompts", str(prompts), "--max-tokens", "9", "--warmup", "1",
                         "--quiet", "--meta-json", json.dumps(meta), "--thinking", "off",
                         "--model-dir", str(hybrid), "--bandwidth-gbs", "100"])
    assert rc == 0
    doc = json.loads(next(out.glob("*.json")).read_text())
    c = doc["ceiling"]
    assert c["lm_head"] == "int8" and c["bandwidth_gbs"] == 100
    assert c["context_tokens"] == bc.run_context(doc) > 0
    assert c["bytes"]["kv_cache"] == c["kv_bytes_per_context_token"] * c["context_tokens"]
    assert c["ceiling_tok_s"] == pytest.approx(100e9 / c["bytes_per_token"])
    assert bench.main(["report", str(out), "--no-charts"]) == 0
    md = (out / "report" / "report.md").read_text()
    assert "## Physical ceiling" in md and "| mtp-k2 | int8 |" in md
