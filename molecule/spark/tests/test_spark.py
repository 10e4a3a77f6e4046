"""Verify a real, provisioned DGX Spark: the checks of the rehearsal that hold on real hardware."""

from __future__ import annotations

import json


def _fact(host, name: str) -> dict:
    return json.loads(host.file(f"/etc/ansible/facts.d/{name}.fact").content_string)


def test_preflight_really_checked_the_gpu(host):
    fact = _fact(host, "spark_preflight")
    assert fact["testbed"] is False
    assert fact["gpu_checks"] == "passed"
    assert fact["gpu_name"] == "NVIDIA GB10"
    assert fact["compute_cap"] == "12.1"
    assert fact["architecture"] == "aarch64"
    assert fact["nvidia_runtime"] is True


def test_image_was_built_for_sm121(host):
    build = _fact(host, "spark_build")
    for variant in build["variants"].values():
        assert any("sm_121" in a for a in variant["checks"]["archs"]), variant
        assert variant["checks"]["torch_cuda"].startswith("13.")


def test_served_model_is_a_verified_hybrid_with_mtp(host):
    model = _fact(host, "spark_model")
    assert model["hybrid_verified"] is True
    res = host.run(f"python3 /opt/sparkllm/scripts/verify_checkpoint.py --expect-mtp --expect-hybrid "
                   f"{model['hybrid']['dir']}")
    assert res.rc == 0, res.stdout + res.stderr


def test_exactly_one_server_runs_and_answers(host):
    serve = _fact(host, "spark_serve")
    out = host.run("systemctl list-units --state=active --no-legend --plain 'sparkllm-vllm-*'").stdout
    active = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert active == {serve["unit"]}
    models = host.run(f"curl -sf {serve['base_url']}/v1/models")
    assert models.rc == 0 and serve["served_model_name"] in models.stdout


def test_speculation_metrics_are_exported(host):
    serve = _fact(host, "spark_serve")
    metrics = host.run(f"curl -sf {serve['base_url']}/metrics").stdout
    assert "vllm:generation_tokens_total" in metrics
    if serve["active_method"] != "baseline":
        assert "vllm:spec_decode_num_drafts_total" in metrics
