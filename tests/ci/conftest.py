"""Make `import tools.ci` work: the CI logic lives in the repository's tools/ folder, which is not
an installed distribution. tools/ has no __init__.py (it is a namespace package, so that
`python tools/proto_gen.py` keeps working)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
