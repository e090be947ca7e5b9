"""``python -m tickloom``: the same as the ``tickloom`` command."""

import sys

from tickloom.tools.cli import main

sys.exit(main())
