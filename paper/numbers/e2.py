"""E2 Inductor codegen: the numbers and table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, table


def e2(n: Numbers, results: Path, gen: Path) -> None:
    df = pd.read_csv(results / "inductor_codegen.csv")
    t = pd.DataFrame(
        {
            "program": df.program,
            "mode": df["mode"].str.replace("max-autotune-no-cudagraphs", "max-autotune-no-cg"),
            "shape": df.apply(lambda r: f"{r.m}x{r.n}x{r.k}", axis=1),
            "decompose-K": df.decompose_k.map({True: "yes", False: "no"}).fillna("-"),
            "S": df.split_k.astype(object)
            .fillna("")
            .astype(str)
            .str.replace("null", "-")
            .str.replace(".0", "", regex=False),
            "ReLU": df.relu.fillna("-"),
            "kernels": df.n_kernel_launches.fillna(0).astype(int).astype(str),
        }
    )
    write_text(
        gen / "table_e2.tex",
        table(
            t,
            "E2: what Inductor emitted for ReLU(A@B) in bf16 (read from its "
            "output code; kernels = launches incl.\\ extern calls).",
            "tab:e2",
        ),
    )
    big = df[
        (df.program == "relu(mm)")
        & (df["mode"] == "max-autotune-no-cudagraphs")
        & (df.k == 32768)
        & (df.m == 16)
    ]
    if len(big):
        n.add("ETwoSplit", str(big.split_k.iloc[0]).replace(".0", ""))
        n.add("ETwoRelu", str(big.relu.iloc[0]))
    small = df[(df.program == "relu(mm)") & (df["mode"] == "max-autotune-no-cudagraphs") & (df.k == 256)]
    if len(small):
        n.add("ETwoSmallRelu", str(small.relu.iloc[0]))
