"""scripts/ops_watchdog.py against the stand-in server in wedge mode and a fake systemctl (issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import ops_watchdog as wd
import pytest
from fixtures.standin_server.server import Config, StandinServer


@pytest.fixture
def bed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    wedge = tmp_path / "wedge"
    monkeypatch.setenv("STANDIN_WEDGE_FILE", str(wedge))
    calls = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = show ]; then echo ActiveState=$(cat {tmp_path}/active); echo InvocationID=inv1; '
        "echo ActiveEnterTimestampMonotonic=0; exit 0; fi\n"
        f'echo "$@" >> {calls}\n'
    )
    fake.chmod(0o755)
    (tmp_path / "active").write_text("active\n")
    srv = StandinServer(Config(model="m")).start()
    yield tmp_path, wedge, calls, fake, srv
    wedge.unlink(missing_ok=True)
    srv.stop()


def _args(tmp: Path, fake: Path, srv: StandinServer, *extra: str):
    return wd.parse_args(["--unit", "u.service", "--url", srv.base_url, "--state", str(tmp / "st.json"),
                          "--failures", "2", "--max-restarts", "1", "--timeout", "0.5", "--grace", "0",
                          "--timer", "w.timer", "--systemctl", str(fake), *extra])


def _calls(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def test_wedged_health_restarts_after_n_failures_then_gives_up(bed, capsys) -> None:
    tmp, wedge, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    assert wd.run(a) == 0 and _calls(calls) == []  # healthy
    wedge.touch()  # the process lives on, /health hangs
    assert wd.run(a) == 0 and _calls(calls) == []  # 1 of 2
    assert wd.run(a) == 0 and _calls(calls) == ["restart --no-block u.service"]
    assert wd.run(a) == 0 and wd.run(a) == 1  # one restart allowed per window: gave up
    assert _calls(calls)[1:] == ["stop --no-block u.service", "stop --no-block w.timer"]
    assert "GAVE UP" in capsys.readouterr().out
    assert json.loads((tmp / "st.json").read_text())["gave_up"] > 0


def test_a_stopped_unit_is_never_probed_nor_started(bed) -> None:
    tmp, wedge, calls, fake, srv = bed
    (tmp / "active").write_text("inactive\n")
    wedge.touch()
    a = _args(tmp, fake, srv)
    for _ in range(4):
        assert wd.run(a) == 0
    assert _calls(calls) == []


def test_a_loading_server_is_not_judged_within_its_grace(bed) -> None:
    tmp, wedge, calls, fake, srv = bed
    wedge.touch()
    a = _args(tmp, fake, srv, "--grace", str(10**9))
    for _ in range(4):
        assert wd.run(a) == 0
    assert _calls(calls) == []


def test_a_start_after_the_give_up_resets_the_rate_limit(bed, capsys) -> None:
    tmp, wedge, calls, fake, srv = bed
    a = _args(tmp, fake, srv)
    wedge.touch()
    results = [wd.run(a) for _ in range(4)]  # 2 failures -> restart, 2 more -> give up
    assert results == [0, 0, 0, 1]
    # the operator fixed it and started unit and timer again: the next failures restart, not give up
    assert wd.run(a) == 0 and wd.run(a) == 0
    assert _calls(calls)[-1] == "restart --no-block u.service"
    assert "restart count reset" in capsys.readouterr().out
    assert not json.loads((tmp / "st.json").read_text())["gave_up"]


def test_the_one_token_completion_catches_an_engine_stuck_behind_a_healthy_api(bed, tmp_path, monkeypatch,
                                                                              capsys) -> None:
    """vLLM's API server can answer /health while its engine hangs: --completion-model asks for one token,
    and that probe (not /health) finds it. A wrong model name is a failure too (vLLM answers 404)."""
    tmp, wedge, calls, fake, srv = bed
    engine_wedge = tmp_path / "engine-wedge"
    monkeypatch.setenv("STANDIN_ENGINE_WEDGE_FILE", str(engine_wedge))
    plain = _args(tmp, fake, srv)
    probing = _args(tmp, fake, srv, "--completion-model", "m")
    assert wd.probe(probing) == ""  # healthy: /health 200 and one token
    assert wd.probe(_args(tmp, fake, srv, "--completion-model", "other")) == "HTTP 404"
    engine_wedge.touch()
    try:
        assert wd.probe(plain) == ""  # /health alone sees nothing wrong...
        assert wd.probe(probing).startswith("no answer")  # ...the completion times out
        assert wd.run(probing) == 0 and wd.run(probing) == 0
        assert _calls(calls) == ["restart --no-block u.service"]
    finally:
        engine_wedge.unlink()


def test_the_completion_probe_sends_the_api_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    with StandinServer(Config(model="m", api_key="s3cret")) as srv:
        base = ["--unit", "u.service", "--url", srv.base_url, "--state", str(tmp_path / "st.json"),
                "--timeout", "2", "--completion-model", "m"]
        assert wd.probe(wd.parse_args(base)) == "HTTP 401"  # vLLM refuses /v1/* without the key
        assert wd.probe(wd.parse_args([*base, "--api-key-file", str(key)])) == ""
