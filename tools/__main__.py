"""``python -m tools``: the same as the ``tickloom`` command."""

import sys

from tools.cli import main

sys.exit(main())
