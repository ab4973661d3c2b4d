"""A run's environment from its name: a built-in (`calculator`, `python`) or `package.module:Class`
(imported and constructed without arguments). Called in the environment worker processes, never in
the rollout service's own."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from furlong.core.settings.environment import BUILTIN_ENVIRONMENTS
from furlong.rollout.core.environment import Environment


def _calculator() -> Environment:
    from furlong.rollout.environments.calculator import CalculatorEnvironment

    return CalculatorEnvironment()


def _python() -> Environment:
    from furlong.rollout.environments.python_tool import PythonEnvironment

    return PythonEnvironment()


_BUILTINS: dict[str, Callable[[], Environment]] = {"calculator": _calculator, "python": _python}
assert tuple(_BUILTINS) == BUILTIN_ENVIRONMENTS


def build_environment(name: str) -> Environment:
    """ValueError naming `name` when it is neither a built-in nor an importable class."""
    if name in _BUILTINS:
        return _BUILTINS[name]()
    module_name, _, class_name = name.partition(":")
    if not module_name or not class_name:
        raise ValueError(
            f"environment {name!r} is not one of {list(BUILTIN_ENVIRONMENTS)} nor 'module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"environment {name!r}: cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not callable(cls):
        raise ValueError(f"environment {name!r}: {module_name!r} has no class {class_name!r}")
    env = cls()
    if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
        raise ValueError(f"environment {name!r}: {class_name} has no reset and step methods")
    return env  # type: ignore[no-any-return]
