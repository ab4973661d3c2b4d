"""Fixtures of the dashboard tests; the helpers live in dash_stack.py (importable by test modules)."""

from dash_stack import local_run  # noqa: F401  (session fixture: a finished run on a local stack)
