"""Generate the Python code for proto/furlong/v1/*.proto into libs/proto, or check it for drift.

    python tools/proto_gen.py          # regenerate libs/proto/furlong/v1/*_pb2*.py(i)
    python tools/proto_gen.py --check  # exit 1 and list the files that differ from a fresh generation

grpc_tools runs in its own subprocess: importing it next to nixl crashes the process.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "libs" / "proto"
PACKAGE_DIR = Path("furlong") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto file, writing under out_root; returns the generated files."""
    protos = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    return sorted(p for p in (out_root / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def drift() -> list[str]:
    """Names of generated files that are missing, extra or different in libs/proto."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        committed = {
            p.name: p for p in (OUT_ROOT / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES)
        }
        problems = [f"missing: {n}" for n in sorted(fresh.keys() - committed.keys())]
        problems += [f"extra: {n}" for n in sorted(committed.keys() - fresh.keys())]
        problems += [
            f"differs: {n}"
            for n in sorted(fresh.keys() & committed.keys())
            if not filecmp.cmp(fresh[n], committed[n], shallow=False)
        ]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift instead of writing")
    args = parser.parse_args()
    if args.check:
        problems = drift()
        for p in problems:
            print(p)
        if problems:
            print("generated code is stale: run `make proto`", file=sys.stderr)
        return 1 if problems else 0
    for p in generate(OUT_ROOT):
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
