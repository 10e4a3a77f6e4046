"""Command-line plumbing every tool shares (standard library only): the help layout, the parser built
from a script's docstring, the two error kinds, the exit codes and the signals.

Every tool exits 0 when its work is done, 1 when the work failed and 2 on a usage error (bad arguments,
an input or destination the tool may not use), printing one line ``TOOL: error: MESSAGE`` on standard
error for 1 and 2. A tool that stops cleanly on a signal (``sigterm_unwinds``) exits 130 after SIGINT
(Ctrl-C) and 143 after SIGTERM, 128 plus the signal's number as a shell reports it.

The tools copied onto the Spark with this package (role spark_tools) import it there too: it must stay
standard library only.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}

ExcTypes = tuple[type[BaseException], ...]


class UsageError(Exception):
    """The command line is wrong (exit 2); the message names the problem and the fix."""


class WorkFailed(Exception):
    """The work was attempted and failed (exit 1); the message says why."""


class Interrupted(BaseException):
    """SIGTERM arrived; like KeyboardInterrupt (SIGINT) it unwinds, so temporary files go."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and names every option's default (unless its help already does,
    or the option has no default: a required option, or one whose help says what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def doc_parser(prog: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of ``doc`` (the script's docstring) and whose
    epilog is the rest of it, laid out as written, with every option's default named."""
    head, _, rest = (doc or "").strip("\n").partition("\n\n")
    kwargs.setdefault("formatter_class", HelpFormatter)
    return argparse.ArgumentParser(prog=prog, description=head, epilog=rest or None, **kwargs)


def say_error(tool: str, message: object, rc: int) -> int:
    """Print ``TOOL: error: MESSAGE`` on standard error; return ``rc`` (the exit code)."""
    print(f"{tool}: error: {message}", file=sys.stderr, flush=True)
    return rc


def run_main(tool: str, body: Callable[[], int | None], *, usage: ExcTypes = (),
             failed: ExcTypes = ()) -> int:
    """Run ``body`` and turn its outcome into the exit code: its own return value (None: 0); a
    UsageError, or one of ``usage``, is reported in one line and exits 2; a WorkFailed, or one of
    ``failed``, is reported the same way and exits 1. ``usage`` is tried first, so a usage class that
    derives from a failure class still exits 2."""
    try:
        return int(body() or EXIT_DONE)
    except (UsageError, *usage) as exc:
        return say_error(tool, exc, EXIT_USAGE)
    except (WorkFailed, *failed) as exc:
        return say_error(tool, exc, EXIT_FAILED)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises Interrupted where the process is, so ``finally`` blocks
    and ``except`` clauses clean up as they do after Ctrl-C; the old handler comes back afterwards."""

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def signal_exit(exc: KeyboardInterrupt | Interrupted) -> tuple[str, int]:
    """(signal name, exit code) for a KeyboardInterrupt (SIGINT) or an Interrupted (SIGTERM)."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    return signal.Signals(signum).name, EXIT_SIGNAL[signum]


def subcommands(parser: argparse.ArgumentParser) -> Callable[..., argparse.ArgumentParser]:
    """Give ``parser`` required subcommands (their name in ``cmd``); returns ``add(name, help, **kw)``,
    which adds one laid out like its parent (HelpFormatter)."""
    sub = parser.add_subparsers(dest="cmd", required=True)

    def add(name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:  # noqa: A002 - argparse's name
        kwargs.setdefault("formatter_class", HelpFormatter)
        return sub.add_parser(name, help=help, **kwargs)

    return add
