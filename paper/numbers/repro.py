"""The write-up's reproducibility table (table_repro.tex): each figure and table, the CSV it is drawn from,
the commit and Triton version that CSV was measured with (its rows' provenance columns) and the command that
measures it. The one place in the write-up that names commits."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, commits_of, table, tex_escape

# (what the write-up shows, the CSV it reads, the command that writes that CSV); experiments first, then
# the tuners and the probes the probe table cites. ``<gpu>`` is the results folder, e.g. nvidia-h200.
EXPERIMENTS = [
    (r"Tab.~\ref{tab:e1}", "compile_modes", "experiments.e1_compile_modes"),
    (r"Tab.~\ref{tab:e2}", "inductor_codegen", "experiments.e2_inductor_codegen"),
    (r"Fig.~\ref{fig:e3}, Tab.~\ref{tab:e3}", "epilogue_fusion", "experiments.e3_epilogue_fusion"),
    (r"Fig.~\ref{fig:e4}", "split_sweep", "experiments.e4_split_sweep"),
    (
        r"Fig.~\ref{fig:e5}, Tabs.~\ref{tab:summary}, \ref{tab:e5}, \ref{tab:e5shapes}",
        "decompose_k_grid",
        "experiments.e5_decompose_k_grid",
    ),
    (
        r"Fig.~\ref{fig:e6}, Tabs.~\ref{tab:summary}, \ref{tab:e6}",
        "router_gemm",
        "experiments.e6_router_gemm",
    ),
    (
        r"Fig.~\ref{fig:e7}, Tabs.~\ref{tab:summary}, \ref{tab:e7}, \ref{tab:e7heldout}",
        "grouped_skew",
        "experiments.e7_grouped_skew",
    ),
    (
        r"Fig.~\ref{fig:e8}, Tabs.~\ref{tab:summary}, \ref{tab:e8}",
        "moe_layer",
        "experiments.e8_moe_layer",
    ),
    (r"Fig.~\ref{fig:e9}, Tabs.~\ref{tab:summary}, \ref{tab:e9}", "moe_train", "experiments.e9_moe_train"),
    (r"Sec.~\ref{sec:kernels}", "tune_decompose_k", "experiments.tune_decompose_k"),
    (r"Sec.~\ref{sec:kernels}", "tune_seed", "experiments.tune_seed"),
    (r"Sec.~\ref{sec:grouped}, Tab.~\ref{tab:probes}", "tune_grouped", "experiments.tune_grouped"),
    (
        r"Sec.~\ref{sec:grouped}",
        "distill_grouped",
        "experiments.distill_grouped --csv DIR/tune_grouped.csv --out src/moegemm/tuned/grouped_default/"
        "<gpu>.json --loo CSV",
    ),
    (r"Sec.~\ref{sec:grouped}", "probe_first_call", "probes.probe_first_call --cells dbrx:4096"),
]
# The probes of the probe table (Tab. probes), by their CSV; each is run as ``python -m probes.<name>``,
# except those no longer in the tree, run at their commit from experiments/ (REMOVED).
PROBES = {  # CSV: the probe table's row it is drawn from
    "probe_dk_latency": "Decompose-K latency",
    "probe_dk_design": "Decompose-K design",
    "probe_prefill_tiles": "Prefill time",
    "probe_prefill_counters": "Counters",
    "probe_prefill_timing": "Counters",
    "probe_mixed_order": "Tile order",
    "probe_stream_k": "Stream-K",
    "probe_gluon_prefill": "Warp specialisation",
    "probe_power": "Power",
    "probe_heldout_ceilings": "Held-out ceiling",
    "probe_ffn_ceiling": "FFN ceiling",
    "probe_host_cost": "Host cost",
    "probe_backward": "Training backward",
    "probe_dswiglu_split": "SwiGLU backward tiles",
    "probe_dswiglu_flatten": "SwiGLU form",
    "probe_dswiglu_separate": "SwiGLU form",
    "probe_swiglu_accuracy": "SwiGLU form",
    "probe_cluster_dk": "Clustered Decompose-K",
    "probe_cluster_grouped": "Multicast grouped",
}
REMOVED = {"probe_stream_k": "experiments.probe_stream_k"}
# CSVs a CPU step computes from another CSV (no provenance columns of their own): that CSV's commit and Triton
DERIVED = {"distill_grouped": "tune_grouped"}
# probes run with arguments of their own, or whose CSV another module writes: the module with the arguments
# that made the committed CSV
COMMANDS = {
    "probe_dk_latency": "probes.probe_dk_latency --screen --out CSV",
    "probe_host_cost": "probes.probe_host_cost --tokens 1,16,64,256 --out CSV",
    "probe_prefill_counters": "probes.probe_prefill_counters --counters-budget-s 400 --case-timeout-s 90 "
    "--deadline-s 560 --out DIR/probe_prefill_timing.csv --counters-out CSV",
    "probe_prefill_timing": "probes.probe_prefill_counters --counters-budget-s 400 --case-timeout-s 90 "
    "--deadline-s 560 --out CSV --counters-out DIR/probe_prefill_counters.csv",
    "probe_dswiglu_split": "probes.probe_backward --pieces dswiglu --out CSV",
    "probe_dswiglu_flatten": "probes.probe_backward --pieces dswiglu --steps --out CSV",
    "probe_swiglu_accuracy": "probes.probe_separate_accuracy --out CSV",
    "probe_dswiglu_separate": (
        "probes.probe_backward --pieces dswiglu --steps --configs separate 128x256x64/w8s3e4 auto --out CSV"
    ),
    "probe_cluster_dk": "probes.cluster_bench --parts checks dk --out-dir DIR",
    "probe_cluster_grouped": "probes.cluster_bench --parts grouped --out-dir DIR",
}


def command(module: str) -> str:
    """A command as the table shows it: the module, its arguments and where it writes (``CSV``, ``DIR``),
    ``--out CSV`` where the entry names neither."""
    return module if re.search(r"(^|[ /])(CSV|DIR)([ /]|$)", module) else f"{module} --out CSV"


def provenance_of(path: Path) -> tuple[str, str]:
    """(the commits a CSV's rows were measured at, short, "+" where the tree had uncommitted changes; its
    Triton versions) from its provenance columns, or for a CSV written without them from its record in
    provenance_files.csv beside it (taken from RUNS.md); "--" where it has neither."""
    commits = commits_of(path)
    if commits is None:  # a CSV written without provenance columns: its record in provenance_files.csv
        side = path.parent / "provenance_files.csv"
        if side.exists():
            rec = pd.read_csv(side, dtype=str)
            rec = rec[rec.file == path.name]
            if len(rec):
                r = rec.iloc[0]
                return r.commit[:7] + ("+" if r.dirty == "True" else ""), r.triton
        return "--", "--"
    df = pd.read_csv(path, usecols=lambda c: c in ("git_dirty", "triton"))
    dirty = df.git_dirty.astype(str).eq("True") if "git_dirty" in df else pd.Series(False, index=df.index)
    marks = sorted({c[:7] + ("+" if d else "") for c, d in zip(commits, dirty)})
    triton = ", ".join(sorted(set(df.triton.dropna().astype(str)))) if "triton" in df else "--"
    return ", ".join(marks), triton or "--"


def command_cell(module: str, width: int = 38) -> str:
    """The module and its arguments in typewriter type, over several lines (broken at spaces, and a path
    longer than a line after a slash) where it is longer than ``width`` characters, so that the table keeps
    to the text width."""
    lines: list[str] = []
    for word in module.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
            continue
        while len(word) > width and "/" in word[:width]:
            cut = word[:width].rindex("/") + 1
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    cells = [f"\\texttt{{{tex_escape(line)}}}" for line in lines]
    return cells[0] if len(cells) == 1 else "\\shortstack[l]{" + "\\\\".join(cells) + "}"


def repro(n: Numbers, results: Path, gen: Path) -> None:
    """table_repro.tex: a row per figure/table group of the write-up with its CSV, commit, Triton and
    command; rows whose CSV is not committed are left out."""
    rows = []
    for what, csv, module in EXPERIMENTS + [
        (rf"Tab.~\ref{{tab:probes}}: {row}", p, REMOVED.get(p, COMMANDS.get(p, f"probes.{p}")))
        for p, row in PROBES.items()
    ]:
        path = results / f"{csv}.csv"
        if not path.exists():
            continue
        commit, triton = provenance_of(path)
        if csv in DERIVED and commit == "--" and (results / f"{DERIVED[csv]}.csv").exists():
            commit, triton = provenance_of(results / f"{DERIVED[csv]}.csv")
            commit += "$^\\dagger$"
        rows.append(
            {
                "shown in": what,
                "CSV": f"\\texttt{{{tex_escape(csv)}}}",
                "commit": commit,
                "Triton": triton,
                "command": command_cell(command(module)) + ("$^*$" if module in REMOVED.values() else ""),
            }
        )
    write_text(
        gen / "table_repro.tex",
        table(
            pd.DataFrame(rows),
            "Each figure and table, its CSV (\\texttt{results/<gpu>/<CSV>.csv}), the commit and Triton its "
            "rows record (``+'': uncommitted changes), and the command that measures it, run as "
            "\\texttt{python -m} and the command (\\texttt{CSV}: \\texttt{results/<gpu>/<CSV>.csv}; "
            "\\texttt{DIR}: \\texttt{results/<gpu>}; $^*$: no longer in the tree; $^\\dagger$: computed on a "
            "CPU from the step before's CSV, whose commit it shows).",
            "tab:repro",
            "lllll",
            raw=("shown in", "CSV", "commit", "command"),
            colsep=2,
            long=True,
        ),
    )
