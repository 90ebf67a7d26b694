"""How every ``recpipe`` command prints its help: a description and each option's default."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "add_command"]


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default, except where there is nothing to show (a flag, no default) or
    the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "default" not in text
            and action.default not in (None, False, [], argparse.SUPPRESS)
            and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        ):
            text += " (default: %(default)s)"
        return text


def add_command(sub: argparse._SubParsersAction, name: str, help: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand with a one-line ``help`` (in ``recpipe --help``) and a ``description`` (in its own help)."""
    return sub.add_parser(name, help=help, description=description, formatter_class=HelpFormatter, **kwargs)
