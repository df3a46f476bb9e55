"""The test modules import their helpers as top-level modules (`import
support`), as tests/run.py loads them, with tests/ as the top level. Imported
as a package instead (`python3 -m unittest tests.test_unit` from the
repository root), they find those helpers through this: tests/ on sys.path."""

import os
import sys

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
