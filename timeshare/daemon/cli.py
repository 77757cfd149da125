"""`timeshare`: the command line. Subcommands so far: `state diagram`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from timeshare.state.diagram import mermaid


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="timeshare", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    state = commands.add_parser("state", help="the job's phase machine")
    state_commands = state.add_subparsers(dest="state_command", required=True)
    state_commands.add_parser("diagram", help="print the transition table as a Mermaid diagram")
    args = parser.parse_args(argv)
    if (args.command, args.state_command) == ("state", "diagram"):
        sys.stdout.write(mermaid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
