"""Lets the format tests import their checkpoint builders."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
