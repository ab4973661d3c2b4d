"""`python -m furlong.ledger --redis-url URL RUN_ID`: print a run's group-ledger audit as JSON; exit 3
when something was lost, trained twice or drawn by an uncommitted version."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import redis

from furlong.core.errors import UnavailableError
from furlong.ledger.group_ledger import audit


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m furlong.ledger",
        description="Print the group-ledger audit of a run as JSON.",
    )
    p.add_argument("run_id")
    p.add_argument("--redis-url", required=True)
    p.add_argument(
        "--finished-step",
        type=int,
        default=None,
        help="count lost ids up to this step (default: the last checkpointed step)",
    )
    args = p.parse_args(argv)
    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    try:
        result = audit(client, args.run_id, args.finished_step)
    except UnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    return 0 if result.lost == 0 and result.trained_twice == 0 and result.versions_ok else 3


if __name__ == "__main__":
    sys.exit(main())
