"""`timeshare`: the command line.

    timeshare config show CONFIG    the effective config, each key with where it came from
    timeshare state diagram         the phase machine's table as a Mermaid diagram

Exit codes: 0 done, 2 bad input (an unusable config names the key and its source).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from timeshare.config import effective_lines, load_config
from timeshare.errors import ConfigError
from timeshare.state.diagram import mermaid

EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "config":
            sys.stdout.write("\n".join(effective_lines(load_config(args.config))) + "\n")
        elif args.command == "state":
            sys.stdout.write(mermaid())
    except ConfigError as exc:
        print(f"timeshare: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timeshare", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="the job's configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the effective config and its sources")
    show.add_argument("config", type=Path)
    state = commands.add_parser("state", help="the job's phase machine")
    state_commands = state.add_subparsers(dest="state_command", required=True)
    state_commands.add_parser("diagram", help="print the transition table as a Mermaid diagram")
    return parser


if __name__ == "__main__":
    sys.exit(main())
