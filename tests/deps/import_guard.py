"""Import modules with only an allowed set of packages importable, and report what failed.

Run as a script in a fresh, isolated interpreter: `python -I import_guard.py SPEC`, SPEC a JSON
object {"top_level": [...], "furlong": [...], "imports": [...], "path": [...]}: the third-party
top-level module names that may be imported (the standard library always may), the x of each
furlong.x that may, what to import, each a module name or "module:attribute" (a console-script
entry point), and optionally directories to put first on sys.path. Prints
one JSON line: {"imported": [...], "failed": {import: error}, "hidden": [...]}, where hidden names
the refused modules that this environment does have.

A refused module is made absent, not broken: every finder on sys.meta_path is wrapped so that it
does not find it. `import x` then raises ModuleNotFoundError and `importlib.util.find_spec("x")`
returns None, as in an environment without x, so optional-import probes take their fallback. Knows
nothing about distributions: tests/deps/test_deps_entry_points.py computes the allowed sets.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback


class DeclaredOnly:
    """The first finder on sys.meta_path: finds nothing itself, wraps every other finder (also those
    added after it was installed) in a `Hiding` that refuses what `refuses` says."""

    def __init__(self, top_level: set[str], furlong: set[str]) -> None:
        self.top_level = top_level
        self.furlong = furlong
        self.hidden: set[str] = set()

    def refuses(self, fullname: str) -> bool:
        parts = fullname.split(".")
        if parts[0] == "furlong":
            return len(parts) > 1 and parts[1] not in self.furlong
        if parts[0].startswith("_sysconfigdata_"):  # the standard library's, named per platform
            return False
        return parts[0] not in self.top_level and parts[0] not in sys.stdlib_module_names

    def install(self) -> None:
        sys.meta_path.insert(0, self)
        self.wrap_finders()

    def wrap_finders(self) -> None:
        for index, finder in enumerate(sys.meta_path):
            if not isinstance(finder, DeclaredOnly | Hiding):
                sys.meta_path[index] = Hiding(finder, self)

    def find_spec(self, fullname, path=None, target=None):
        self.wrap_finders()
        return None


class Hiding:
    """One meta path finder, blind to the modules its guard refuses."""

    def __init__(self, inner, guard: DeclaredOnly) -> None:
        self.inner = inner
        self.guard = guard

    def find_spec(self, fullname, path=None, target=None):
        found = self.inner.find_spec(fullname, path, target)
        if found is not None and self.guard.refuses(fullname):
            self.guard.hidden.add(fullname)
            return None
        return found

    def __getattr__(self, name):  # invalidate_caches, find_distributions (importlib.metadata)
        return getattr(self.inner, name)


def import_one(name: str) -> None:
    module_name, _, attribute = name.partition(":")
    target = importlib.import_module(module_name)
    for part in filter(None, attribute.split(".")):
        target = getattr(target, part)


def main(spec: dict) -> dict:
    sys.path[:0] = spec.get("path", [])
    guard = DeclaredOnly(set(spec["top_level"]), set(spec["furlong"]))
    guard.install()
    imported, failed = [], {}
    for name in spec["imports"]:
        try:
            import_one(name)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, SystemExit too
            failed[name] = "".join(traceback.format_exception_only(exc)).strip()
        else:
            imported.append(name)
    return {"imported": imported, "failed": failed, "hidden": sorted(guard.hidden)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
