"""Generate every number and table the paper quotes, from results/<gpu>/ (never typed by hand).

    python -m paper.make_numbers --results results/nvidia-h200 --out paper/generated

Writes numbers.tex (one \\newcommand per number the paper or the README quotes, and no other) and table_*.tex.
Each experiment's numbers live in its own module under paper/numbers/ (e1..e10, e7_heldout for E7's held-out
models, e7_tuner for E7's tuner, repro for the reproducibility table, readme for the README's block; common
for the helpers, latex for the macros and tables), the probes' in paper/numbers/probes.py; this command runs
them all.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments._io import write_text
from paper.numbers import e1, e2, e3, e4, e5, e6, e7, e7_heldout, e7_tuner, e8, e9, e10, probes, repro
from paper.numbers.common import Numbers, provenance
from paper.numbers.readme import headline, summary, update_readme
from paper.numbers.runtime import runtime, runtime_block


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--readme", help="also rewrite this README's summary table, and the headline block of docs/results.md"
    )
    a = ap.parse_args()
    results, gen = Path(a.results), Path(a.out)
    t, p = e7_tuner, probes
    n = Numbers()
    provenance(n, results)
    for f in (e1.e1, e2.e2, e3.e3, e4.e4, e5.e5, e6.e6, e7.e7, e7_heldout.e7_heldout, e8.e8, e9.e9, e10.e10):
        f(n, results, gen)
    for f in (
        e1.e1_against_e5,
        e5.heuristic_vs_tuned,
        t.tails,
        t.merged_tails,
        t.tma_splits,
        t.extra_rows,
        p.prefill_probe,
        p.prefill_counters,
        p.stream_k_probe,
        p.mixed_order_probe,
        p.heldout_ceilings_probe,
        p.gluon_probe,
        p.dk_design_probe,
        p.dk_latency_probe,
        p.backward_probe,
        p.cluster_probe,
        p.first_call_probe,
    ):
        f(n, results)
    p.power_probe(n, results, e7.e7_frame(results))
    runtime(n, results, gen)
    repro.repro(n, results, gen)
    write_text(gen / "numbers.tex", n.tex())
    write_text(gen / "headline.md", headline(results) + "\n")
    if a.readme:
        update_readme(Path(a.readme), headline(results), runtime_block(results), summary(results))
    print(f"wrote {gen}/numbers.tex ({len(n.items)} numbers) and tables")


if __name__ == "__main__":
    main()
