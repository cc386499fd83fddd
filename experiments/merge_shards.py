"""Merge the shards of an experiment into its CSV: every shard's rows, in the order given, under the union of
their columns (in order of first appearance). Written atomically; a shard that is missing or has no rows is
an error, so a merged CSV is never short of a shard.

    python -m experiments.merge_shards --out results/<slug>/moe_layer.csv SHARD.csv...
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from experiments._io import atomic_path


def merge(out: Path, shards: list[Path]) -> int:
    rows: list[dict] = []
    fields: list[str] = []
    for path in shards:
        if not path.exists():
            raise SystemExit(f"shards: {path} does not exist")
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            part = list(reader)
            fields += [c for c in (reader.fieldnames or []) if c not in fields]
        if not part:
            raise SystemExit(f"shards: {path} has no rows")
        rows += part
    with atomic_path(out) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("shards", nargs="+", type=Path)
    a = ap.parse_args()
    print(f"wrote {a.out} ({merge(a.out, a.shards)} rows from {len(a.shards)} shards)")


if __name__ == "__main__":
    main()
