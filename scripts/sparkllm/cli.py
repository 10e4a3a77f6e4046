"""Command-line conventions shared by the tools (standard library only)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and names every option's default (unless its help already does,
    or the option has no default: a required option, or one whose help says what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)
