import os
import sys

# The core tests import their shared helpers as a top-level module.
sys.path.insert(0, os.path.dirname(__file__))
