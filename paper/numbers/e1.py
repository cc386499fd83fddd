"""E1 compile-modes: the numbers and table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, paired_rounds, ratio_ci_text, table


def e1(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "compile_modes.csv")
    df["compile_mode"] = df["compile_mode"].fillna("eager")
    short = {"max-autotune-no-cudagraphs": "max-autotune-no-cg"}
    rows = []
    for (f, m, nn, k), g in df.groupby(["function", "m", "n", "k"], sort=False):
        g = g.set_index("compile_mode")
        best_graph = g.drop("eager")["graph_us"].idxmin()
        best_launch = g.drop("eager")["launch_us"].idxmin()
        rows.append(
            [
                f,
                f"{m}x{nn}x{k}",
                g.loc["eager", "graph_us"],
                short.get(best_graph, best_graph),
                g.loc[best_graph, "graph_us"],
                g.loc["eager", "launch_us"],
                short.get(best_launch, best_launch),
                g.loc[best_launch, "launch_us"],
                g["compile_s"].max(),
            ]
        )
    cols = ["function", "shape", "eager", "best mode", "its time", "eager", "best mode", "its time", "[s]"]
    t = pd.DataFrame(rows, columns=cols)
    write_text(
        gen / "table_e1.tex",
        table(
            t,
            "E1: eager and the best \\texttt{torch.compile} mode per function and shape "
            "($M \\times N \\times K$, bf16), on the GPU clock (CUDA-graph replay) and the launch-inclusive "
            "clock (\\texttt{do\\_bench}, L2 flushed), in $\\mu$s; last column: the longest first-call "
            "compile of any mode.",
            "tab:e1",
            "llrlrrlrr",
            groups=[("", 2), ("GPU time", 3), ("launch-inclusive", 3), ("compile", 1)],
            colsep=4,
        ),
    )
    comp = df[df.compile_mode != "eager"]
    n.add("EOneMaxCompileS", comp["compile_s"].max(), "{:.1f}")
    # with their 95% intervals over shapes and rounds: max-autotune (its own CUDA graphs) over the mode
    # without them, launch-inclusive; the seed's decomposeK compiled in the default mode over eager, GPU time
    modes = df.assign(contender=df.compile_mode, status=df.get("status", "ok"))
    keys = ["function", "m", "n", "k"]
    theirs, ours, cells = paired_rounds(modes, keys, "max-autotune", "max-autotune-no-cudagraphs", "launch")
    if len(cells):
        n.add("EOneNoCgVsCgLaunch", ratio_ci_text(theirs, ours))
    dk = modes[modes.function == "decompose_k+relu"]
    theirs, ours, cells = paired_rounds(dk, keys, "eager", "default", "graph")
    if len(cells):
        n.add("EOneDecomposeCompiledVsEager", ratio_ci_text(theirs, ours))


def e1_against_e5(n: Numbers, results: Path) -> None:
    """The one function, mode and shape both E1 and E5 time: relu(mm) in bf16 under
    max-autotune-no-cudagraphs at M=N=16, K=32768 (the first shape they share). The same harness and clock
    time both (CUDA-graph replay of the same number of calls); what differs is what Inductor compiled: E1
    compiles with Inductor's caches off (its compile times are cold), E5 with them on. Macros: the shape,
    and per experiment the GPU time, the split of the decompose-K lowering Inductor chose and the first
    call's wall time (compile included)."""
    e5_path = results / "decompose_k_grid.csv"
    if not e5_path.exists():
        return
    one = pd.read_csv(results / "compile_modes.csv")
    one = one[(one.function == "relu(mm)") & (one.compile_mode == "max-autotune-no-cudagraphs")]
    five = pd.read_csv(e5_path)
    five = five[(five.contender == "compiled") & (five.suite == "bf16-relu") & (five.status == "ok")]
    both = one.merge(five, on=["m", "n", "k"], suffixes=("_one", "_five"))
    if both.empty:
        return
    r = both.iloc[0]
    n.add("EOneEFiveM", int(r.m), "{}")
    n.add("EOneEFiveK", int(r.k), "{}")
    for tag, sfx in (("One", "_one"), ("Five", "_five")):
        n.add(f"EOneEFiveUs{tag}", float(r[f"graph_us{sfx}"]))
        split = r[f"inductor_split_k{sfx}"]
        n.add(f"EOneEFiveSplit{tag}", str(int(split)) if pd.notna(split) else "none")
        n.add(f"EOneEFiveCompileS{tag}", float(r[f"compile_s{sfx}"]))
