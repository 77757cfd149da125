"""`python -m timeshare.daemon` is `timeshared`."""

import sys

from timeshare.daemon.main import main

sys.exit(main())
