"""``python -m plugins.plot``: the ``vasso-plot`` command."""

import sys

from .diagnostics import main

sys.exit(main())
