"""The one CLI scaffold (scripts/sparkllm/cli.py): the parser from a docstring, the exit codes, signals,
and a guard that no tool writes its own again."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from sparkllm import cli

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# (none left: ops_watchdog.py goes onto the Spark with sparkllm/cli.py beside it, role spark_ops)
STANDALONE: set[str] = set()

DOC = """Do one thing (first paragraph: the description).

Second paragraph, laid out
  as written.

Exit codes: 0 done, 1 failed, 2 usage error.
"""


def test_doc_parser_splits_the_docstring_and_names_defaults() -> None:
    p = cli.doc_parser("tool.py", DOC)
    p.add_argument("--step", type=float, default=20, help="seconds this call may run")
    p.add_argument("--name", help="no default to name")
    text = p.format_help()
    assert text.startswith("usage: tool.py ")
    assert p.description == "Do one thing (first paragraph: the description)."
    assert "Second paragraph, laid out\n  as written." in text  # raw layout kept
    assert text.rstrip().endswith("Exit codes: 0 done, 1 failed, 2 usage error.")
    assert "seconds this call may run (default: 20)" in text
    assert "no default to name\n" in text
    assert cli.doc_parser("t", "One line only.").epilog is None


def test_subcommands_are_required_and_laid_out_like_the_parent(capsys: pytest.CaptureFixture[str]) -> None:
    p = cli.doc_parser("tool.py", DOC)
    add = cli.subcommands(p)
    sp = add("go", "go somewhere")
    sp.add_argument("--far", type=int, default=3, help="how far")
    assert p.parse_args(["go"]).cmd == "go"
    assert "how far (default: 3)" in sp.format_help()
    with pytest.raises(SystemExit) as exc:
        p.parse_args([])
    assert exc.value.code == cli.EXIT_USAGE
    assert "required: cmd" in capsys.readouterr().err


class Refused(ValueError):
    pass


def test_run_main_maps_outcomes_to_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    def raising(exc: BaseException):
        def body() -> int:
            raise exc
        return body

    assert cli.run_main("t", lambda: None) == 0
    assert cli.run_main("t", lambda: 1) == 1
    assert cli.run_main("t", raising(cli.UsageError("--x 3: give 1..2"))) == 2
    assert capsys.readouterr().err == "t: error: --x 3: give 1..2\n"
    assert cli.run_main("t", raising(cli.WorkFailed("no answer"))) == 1
    assert capsys.readouterr().err == "t: error: no answer\n"
    # a tool's own classes: usage is tried first, so a usage class derived from a failure class is 2
    assert cli.run_main("t", raising(Refused("not ours")), usage=(Refused,), failed=(ValueError,)) == 2
    assert cli.run_main("t", raising(ValueError("bad")), usage=(Refused,), failed=(ValueError,)) == 1
    assert capsys.readouterr().err == "t: error: not ours\nt: error: bad\n"
    with pytest.raises(KeyError):  # anything else is a bug: it is not turned into an exit code
        cli.run_main("t", raising(KeyError("k")), failed=(ValueError,))


def test_sigterm_unwinds_and_ends_143_and_ctrl_c_130() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cli.Interrupted) as exc, cli.sigterm_unwinds():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(200):  # the handler runs in the main thread at the next bytecode boundary
            time.sleep(0.01)
    assert cli.signal_exit(exc.value) == ("SIGTERM", 143)
    assert signal.getsignal(signal.SIGTERM) == before  # the old handler is back
    assert cli.signal_exit(KeyboardInterrupt()) == ("SIGINT", 130)


def tools() -> list[Path]:
    return sorted([*SCRIPTS.glob("*.py"), *(SCRIPTS / "sparkllm").rglob("*.py")])


@pytest.mark.parametrize("path", tools(), ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_no_tool_writes_its_own_cli_plumbing(path: Path) -> None:
    """The builder, the error kinds and the exit-code mapping live in sparkllm/cli.py only."""
    if path.name == "cli.py" or path.name in STANDALONE:
        return
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"^class (UsageError|WorkFailed|Interrupted)\(", text, re.M), path
    assert "argparse.ArgumentParser(" not in text, f"{path}: build it with sparkllm.cli.doc_parser"
    assert "__doc__.split(" not in text, f"{path}: sparkllm.cli.doc_parser splits the docstring"
    assert not re.search(r"SIG(INT|TERM)\s*:\s*1[34]\d", text), f"{path}: sparkllm.cli.EXIT_SIGNAL"
    assert "add_subparsers(" not in text, f"{path}: use sparkllm.cli.subcommands"
