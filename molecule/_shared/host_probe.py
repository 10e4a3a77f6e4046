"""Small probes of a molecule test host that several scenarios' verify steps share (testinfra ``host``)."""

from __future__ import annotations

import time


def wait_until(pred, timeout: float, what: str, step: float = 0.5):
    """Poll ``pred()`` every ``step`` seconds; return its first truthy value, or fail naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def healthy(host, port: int) -> bool:
    """True when the server on the test host answers /health within a second."""
    return host.run(f"curl -sf --max-time 1 http://127.0.0.1:{port}/health").rc == 0


def host_now(host) -> int:
    """The test host's clock, epoch seconds (for journalctl --since)."""
    return int(host.check_output("date +%s"))


def journal(host, since: int, *args: str) -> str:
    """The host's journal since ``since`` (message text only), narrowed by journalctl ``args``."""
    return host.check_output(f"journalctl --no-pager -o cat --since @{since} {' '.join(args)}")


def invocation(host, unit: str) -> str:
    """The unit's current InvocationID (changes with every start)."""
    return host.check_output(f"systemctl show -p InvocationID --value {unit}")
