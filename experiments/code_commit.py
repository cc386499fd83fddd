r"""Print the commit of the code a measurement here would run (harness.provenance.code_commit): the
newest commit that changed anything but results, write-up, figures and docs. A tree shipped to a GPU machine
without its .git records it so, and a run spread over several checkouts of results-only commits records one
commit:

    c=$(python -m experiments.code_commit) || exit 1
    MOEGEMM_COMMIT=$c MOEGEMM_DIRTY=0 bash experiments/device_pipeline.sh ...

Exits 1 (printing nothing to stdout) where the measured code has uncommitted changes (new files included), 2
without git; a MOEGEMM_COMMIT left empty by a failed call is refused where it is read.
"""

from __future__ import annotations

import argparse
import sys

from experiments.harness.provenance import NOT_MEASURED, code_commit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="the first 7 hex digits")
    args = ap.parse_args(argv)
    found = code_commit()
    if found is None:
        print("no git repository here: the commit of the code cannot be read", file=sys.stderr)
        return 2
    commit, dirty = found
    if dirty:
        print(
            f"the measured code (everything but {', '.join(NOT_MEASURED)}) has uncommitted changes: commit "
            "them first (git status)",
            file=sys.stderr,
        )
        return 1
    print(commit[:7] if args.short else commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
