"""Entry point: `python -m tools.ci COMMAND` from the repository root (see tools/ci/cli.py)."""

import sys

from tools.ci.cli import main

sys.exit(main())
