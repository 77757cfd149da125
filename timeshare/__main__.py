"""`python -m timeshare` is the `timeshare` command."""

import sys

from timeshare.daemon.cli import main

sys.exit(main())
