"""Every command's options as Markdown, written from the commands' own argparse parsers (docs/reference/commands.md).

    python -m megatron_kd_plugin.command_reference > docs/reference/commands.md

``parsers()`` gives each command line's parser without running the command: each command builds its parser in its
``main`` (or ``parse_args``), so ``main`` is called with ``parse_args`` replaced by one that hands the parser back
before anything else happens. ``demo`` has one parser per demo (``demo --mixture`` ...), ``plan`` a second one for
``plan --cache``. The docs test
(tests/test_docs.py) checks the committed page against ``markdown()`` and every command line in the docs against
``parsers()``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from unittest import mock

from megatron_kd_plugin.__main__ import COMMANDS
from megatron_kd_plugin.demo.command import DEFAULT_DEMO, DEMOS

WIDTH = 110
"""Fixed help width, so the page does not depend on the terminal that wrote it."""


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _raise_parser(parser: argparse.ArgumentParser, *args, **kwargs):
    raise _Parsed(parser)


def parser_of(module: str, argv: list[str]) -> argparse.ArgumentParser:
    """The parser that ``module.main(argv)`` parses its arguments with (the command does not run)."""
    main = importlib.import_module(module).main
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _raise_parser):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.parser
    raise RuntimeError(f"{module}.main returned without parsing its arguments")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Command line prefix (``cache``, ``demo --mixture`` ...) -> its parser, in the order of ``__main__``."""
    out = {}
    for command, module in COMMANDS.items():
        if command != "demo":
            out[command] = parser_of(module, [])
            if command == "plan":
                out["plan --cache"] = parser_of(module, ["--cache"])      # the cache command's plan
            continue
        out["demo"] = parser_of(DEFAULT_DEMO, [])
        for flag, (demo_module, _switch) in DEMOS.items():
            out[f"demo {flag}"] = parser_of(demo_module, [])
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}{' ...' if action.nargs in ('*', '+') else ''}`"
    if action.nargs == 0:
        return ", ".join(f"`{name}`" for name in action.option_strings)
    value = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.metavar or action.dest.upper()
    return ", ".join(f"`{name} {value}`" for name in action.option_strings)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    text = formatter._expand_help(action) if action.help else ""
    return ("**required.** " if action.required and action.option_strings else "") + text


def section(name: str, parser: argparse.ArgumentParser) -> str:
    """One command's usage line and options table."""
    parser.formatter_class = lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=WIDTH)
    parser.prog = f"python -m megatron_kd_plugin {name}"
    usage = parser.format_usage().removeprefix("usage: ").strip()
    rows = [f"| {_cell(_option(action))} | {_cell(_help(parser, action))} |"
            for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    summary = (parser.description or "").strip().split("\n\n")[0]
    return "\n".join([f"## `{name}`", "", _cell(summary), "", "```", usage, "```", "",
                      "| option | what it does |", "|---|---|", *rows, ""])


def markdown() -> str:
    head = ["# Command reference", "",
            "Generated from the commands' argparse parsers by `python -m megatron_kd_plugin.command_reference "
            "> docs/reference/commands.md`; tests/test_docs.py fails when this page is not current. "
            "`python -m megatron_kd_plugin COMMAND --help` prints the same with each command's full description.",
            ""]
    return "\n".join(head + [section(name, parser) for name, parser in parsers().items()])


if __name__ == "__main__":
    sys.stdout.write(markdown())
