"""Write the math-word example's data: GSM8K-format JSONL (`question`, `answer` ending in `#### N`)
of simple arithmetic word problems (`problems.py`), a training and a test file, deterministic by
seed (the test file is drawn from its own stream, so the two files differ for any seed; a question
may repeat, as in any generated set).

    .venv/bin/python examples/math-word/make_data.py [--out DIR] [--seed 0] [--train 4000] [--test 200]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from problems import problem

HERE = Path(__file__).resolve().parent


def write_rows(path: Path, seed: int, count: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(problem(rng)) + "\n" for _ in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=HERE / "data", help="directory of train.jsonl and test.jsonl"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=4000, help="training rows")
    parser.add_argument("--test", type=int, default=200, help="test rows")
    args = parser.parse_args()
    for name, seed, count in (("train", args.seed, args.train), ("test", args.seed + 1_000_003, args.test)):
        if count < 1:
            raise SystemExit(f"--{name} must be >= 1, got {count}")
        write_rows(args.out / f"{name}.jsonl", seed, count)
        print(f"wrote {count} rows to {args.out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
