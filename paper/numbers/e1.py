"""E1 compile-modes: the numbers and table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, gm, table


def e1(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "compile_modes.csv")
    df["compile_mode"] = df["compile_mode"].fillna("eager")
    rows = []
    for (f, m, nn, k), g in df.groupby(["function", "m", "n", "k"], sort=False):
        g = g.set_index("compile_mode")
        best_graph = g.drop("eager")["graph_us"].idxmin()
        best_launch = g.drop("eager")["launch_us"].idxmin()
        rows.append(
            {
                "function": f,
                "shape": f"{m}x{nn}x{k}",
                "eager [us]": g.loc["eager", "graph_us"],
                "best mode (GPU clock)": best_graph,
                "its time [us]": g.loc[best_graph, "graph_us"],
                "best mode (launch clock)": best_launch,
                "its latency [us]": g.loc[best_launch, "launch_us"],
                "max compile [s]": g["compile_s"].max(),
            }
        )
    t = pd.DataFrame(rows)
    write_text(
        gen / "table_e1.tex",
        table(
            t,
            "E1: the best \\texttt{torch.compile} mode per function and shape "
            "(GPU clock: CUDA-graph replay; launch clock: do\\_bench).",
            "tab:e1",
            "llrlrlrr",
        ),
    )
    comp = df[df.compile_mode != "eager"]
    n.add("EOneMaxCompileS", comp["compile_s"].max(), "{:.1f}")
    nocg = df[df.compile_mode == "max-autotune-no-cudagraphs"].set_index(["function", "m"])["launch_us"]
    cg = df[df.compile_mode == "max-autotune"].set_index(["function", "m"])["launch_us"]
    n.add("EOneNoCgVsCgLaunch", gm(cg / nocg))
    dk = df[df.function == "decompose_k+relu"]
    n.add(
        "EOneDecomposeCompiledVsEager",
        gm(
            dk[dk.compile_mode == "eager"].set_index("m")["graph_us"]
            / dk[dk.compile_mode == "default"].set_index("m")["graph_us"]
        ),
    )
