"""``python -m infergate``: the same as the ``infergate`` command."""

import sys

from infergate.cli import main

sys.exit(main())
