"""``python -m plugins.lab.plot``: the ``vasso-plot`` command."""

import sys

from .diagnostics import main

sys.exit(main())
