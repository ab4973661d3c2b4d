"""The controller's check of a run's dataset files before the run is stored: every row of each file
it can read is checked (`furlong.core.task_data`), so a malformed row is refused at submission
(REST 422, `furlong run` exit 2) naming the file, the row or line and the field. A file the
controller cannot see (a path only the services' machines have) is left to the rollout service,
which reads and checks every row when the run is configured, before step 1. Knows nothing about
HTTP.
"""

from __future__ import annotations

import logging
from pathlib import Path

from furlong.controller.run_spec import RunSpec
from furlong.core.settings import SettingError
from furlong.core.task_data import DataFileError, RowError, read_data_file

log = logging.getLogger(__name__)


def check_run_data(spec: RunSpec) -> None:
    """SettingError (`data.train` / `data.eval`) for a file that exists here and has a malformed
    row or cannot be read."""
    for name in ("train", "eval"):
        path = getattr(spec.data, name)
        if not path:
            continue
        try:
            visible = Path(path).exists()
        except (OSError, ValueError) as exc:  # an embedded NUL, a name too long
            raise SettingError(f"data.{name}", f"{path!r} is not a usable path: {exc}") from None
        if not visible:
            log.info("data.%s %s is not visible to the controller; rollout checks it", name, path)
            continue
        try:
            read_data_file(path, spec.data)
        except (RowError, DataFileError) as exc:
            raise SettingError(f"data.{name}", str(exc)) from None
