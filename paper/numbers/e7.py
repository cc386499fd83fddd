"""E7 grouped GEMM under skew: the frame every E7 number reads, the practical ceiling, the numbers and
tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from experiments._io import write_text

from .common import Numbers, gm, phase_ci_text, phase_headline, table

OURS_GROUPED = ["ours:contiguous", "ours:persistent"]  # the same tuned tiles on the two grids we ship
# E7's ours: the default path as the library deploys it (grouped_mm with no config); CSVs from before that
# row fall back to the better of the two grids (OURS_GROUPED), and say so (ours_name)
OURS_AUTO = "ours:auto"
OURS_GATHER = "ours:auto+gather"  # the same, with its gather of the rows timed: the peers' work
TK = "tk:matmul_ogs"  # OpenAI's triton_kernels (experiments/triton_kernels_moe.py), an optional contender
E7_KEYS = ["model", "proj", "tokens", "load"]


VLLM = "vllm:fused_moe"  # vLLM's fused-MoE Triton kernel (experiments/vllm_moe.py), an optional contender


STREAM = "ceiling:stream"  # E7's memory ceiling: a kernel moving only the floor's bytes (harness.stream)


def e7_frame(results: Path) -> pd.DataFrame | None:
    """Per (model, proj, tokens, load) of the tune-set models: our best-grid time and % of floor, and
    torch._grouped_mm's."""
    path = results / "grouped_skew.csv"
    return e7_frame_of(pd.read_csv(path)) if path.exists() else None


def tune_split(df: pd.DataFrame) -> pd.DataFrame:
    """E7's rows of the tune-set models (all rows of a CSV from before the held-out split)."""
    return df[df.split != "heldout"] if "split" in df else df


def ours_name(df: pd.DataFrame) -> str:
    """E7's ours in this CSV: ``ours:auto`` where measured, else "best of grids" (older CSVs)."""
    return OURS_AUTO if (df.contender == OURS_AUTO).any() else "best of grids"


def e7_frame_of(df: pd.DataFrame) -> pd.DataFrame:
    df = tune_split(df)
    g = df[(df.status == "ok") & df.proj.isin(["up", "down"])]
    key = E7_KEYS
    mine = [OURS_AUTO] if ours_name(g) == OURS_AUTO else OURS_GROUPED
    ours = g[g.contender.isin(mine)].groupby(key).agg(us=("graph_us", "min"), pct=("pct_floor_graph", "max"))
    tg = g[g.contender == "torch._grouped_mm"].set_index(key)
    ours["tg_us"], ours["tg_pct"] = tg.graph_us, tg.pct_floor_graph
    vl = g[g.contender == VLLM].set_index(key)
    if len(vl):  # vLLM's kernel, where its source was at hand when E7 ran
        ours["vl_us"], ours["vl_pct"] = vl.graph_us, vl.pct_floor_graph
    if "bytes" in g:
        ours["bytes"] = g.groupby(key)["bytes"].first()
    ours["floor_us"] = g.groupby(key)["floor_us"].first()
    ceiling = practical_ceiling(g).set_index(key)
    if len(ceiling):
        ours["ceil_us"] = ceiling.ceil_us
        ours["ceil_pct"] = 100 * ours.floor_us / ours.ceil_us
    return ours.reset_index()


def practical_ceiling(g: pd.DataFrame) -> pd.DataFrame:
    """E7's memory-ceiling rows (ceiling:stream), each with ``ceil_us``, its cell's practical ceiling: the
    slower of two easier problems, each done by a tuned kernel -- streaming the cell's bytes (that row) and
    its FLOPs as one dense GEMM (cuBLAS, one expert's weights; measured at the uniform load only, as it
    depends on the rows only). No rows where E7 measured no ceiling. The numbers and the E7 figure both
    take it from here."""
    st = g[g.contender == STREAM]
    dense = g[g.contender == "dense-reference"].groupby(["model", "proj", "tokens"]).graph_us.first()
    if st.empty or dense.empty:
        return st.iloc[:0].assign(ceil_us=np.nan)
    d = dense.reindex(pd.MultiIndex.from_frame(st[["model", "proj", "tokens"]])).to_numpy()
    return st.assign(ceil_us=np.maximum(st.graph_us.to_numpy(), d))


MATCHED = "ours:matched"  # ours on a peer's work, projection by projection (matched_ours)


def matched_ours(ok: pd.DataFrame, peer: str) -> pd.DataFrame:
    """``ok`` with ours on ``peer``'s work added under the name MATCHED, per projection: ours with its gather
    of the rows timed (``ours:auto+gather``, where measured) where the peer's timed call gathers its rows
    itself, as its ``timing_scope`` says (vLLM's kernel; triton_kernels' gate/up), else ours on rows already
    permuted (``ours:auto``; triton_kernels' down, timed on rows in its sorted order without its scatter). A
    CSV without timing scopes: the gather timed for every projection."""
    gathered = OURS_GATHER if (ok.contender == OURS_GATHER).any() else OURS_AUTO
    theirs = ok[ok.contender == peer]
    parts = [ok]
    for proj, rows in theirs.groupby("proj"):
        scope = rows.timing_scope.dropna().astype(str) if "timing_scope" in rows else pd.Series(dtype=str)
        gathers = scope.empty or scope.str.contains("gather").all()
        mine = ok[(ok.contender == (gathered if gathers else OURS_AUTO)) & (ok.proj == proj)]
        parts.append(mine.assign(contender=MATCHED))
    return pd.concat(parts, ignore_index=True)


def e7_phase_numbers(
    n: Numbers, df: pd.DataFrame, prefix: str, tags: tuple[str, ...] = ("Torch", "Vllm", "Tk")
) -> list[dict]:
    """E7's headline per phase and clock with 95% intervals: each peer's time over ours. Against
    torch._grouped_mm, ours is ``ours:auto`` (both on rows already permuted); against the kernels that gather
    their rows themselves, ours on the same work, projection by projection (:func:`matched_ours`: the
    gather timed against vLLM's kernel and triton_kernels' gate/up, not against triton_kernels' down, timed
    without its scatter). Macros <prefix><Phase>Vs<Peer><Gpu|Launch> (text, "parity" where the interval
    holds 1.0) for the peers named in ``tags``; returns the rows of every peer measured."""
    ok = df[df.proj.isin(["up", "down"])]
    if not (ok.contender == OURS_AUTO).any():
        return []
    rows = []
    for peer, tag, ours in (
        ("torch._grouped_mm", "Torch", OURS_AUTO),
        (VLLM, "Vllm", MATCHED),
        (TK, "Tk", MATCHED),
    ):
        if not (ok.contender == peer).any():
            continue
        for r in phase_headline(matched_ours(ok, peer) if ours == MATCHED else ok, E7_KEYS, peer, ours):
            r["ours"] = ours
            rows.append(r)
            for clock, ct in (("graph", "Gpu"), ("launch", "Launch")):
                if r[f"{clock}_cells"] and tag in tags:
                    n.add(
                        f"{prefix}{r['phase'].capitalize()}Vs{tag}{ct}",
                        phase_ci_text(r, clock),
                    )
    return rows


def e7(n: Numbers, results: Path, gen: Path) -> None:
    """Grouped GEMM under skew on the tune models, when measured: every contender's share of the floor (the
    table), the whole expert path against torch._grouped_mm's, the practical ceiling, and what a skewed load
    costs per unit of floor."""
    path = results / "grouped_skew.csv"
    if not path.exists():
        return
    df = tune_split(pd.read_csv(path))
    o = e7_frame_of(df)
    ok = df[df.status == "ok"]
    g = ok[ok.proj.isin(["up", "down"])]
    # each contender's row label, in words (the CSVs name them ours:auto, ours:contiguous, ...)
    label = {
        OURS_AUTO: "ours, default path",
        OURS_GATHER: "ours, gather timed",
        "ours:contiguous": "ours, tile per program",
        "ours:persistent": "ours, persistent grid",
        "ours:masked": "ours, masked (TMA)",
        "ours:masked-pointer": "ours, masked (pointers)",
        "torch._grouped_mm": "torch._grouped_mm",
        VLLM: "vLLM's kernel",
        TK: "triton_kernels",
        "per-expert-loop": "one GEMM per expert",
        "padded-bmm:cf1.0": "padded, capacity 1.0",
        "padded-bmm:cf1.25": "padded, capacity 1.25",
        "padded-bmm:cf2.0": "padded, capacity 2.0",
    }
    rows = []
    for c in (
        OURS_AUTO,
        OURS_GATHER,
        "ours:contiguous",
        "ours:persistent",
        "ours:masked",
        "ours:masked-pointer",
        "torch._grouped_mm",
        VLLM,
        TK,
        "per-expert-loop",
        "padded-bmm:cf1.0",
        "padded-bmm:cf1.25",
        "padded-bmm:cf2.0",
    ):
        sub = g[g.contender == c]
        if len(sub):
            launch_pct = 100 * sub.floor_us / sub.launch_us
            rows.append(
                {
                    "contender": label[c],
                    "decode % floor": gm(sub[sub.tokens <= 256].pct_floor_graph),
                    "prefill % floor": gm(sub[sub.tokens > 256].pct_floor_graph),
                    "decode, launch": gm(launch_pct[sub.tokens <= 256]),
                    "prefill, launch": gm(launch_pct[sub.tokens > 256]),
                    "rows dropped": int(
                        pd.to_numeric(sub.note.str.extract(r"^(\d+) rows dropped")[0], errors="coerce")
                        .fillna(0)
                        .sum()
                    )
                    if c.startswith("padded")
                    else "--",
                }
            )
    by = {r["contender"]: r for r in rows}
    for c, tag in ((OURS_AUTO, "Auto"), ("ours:masked", "Masked")):  # the masked layout beside the default
        if label[c] in by and np.isfinite(by[label[c]]["decode % floor"]):
            n.add(f"ESeven{tag}DecodePct", by[label[c]]["decode % floor"], "{:.0f}")
    if "ceil_us" in o:  # the practical ceiling of each cell (GPU clock only: its two parts are timed apart)
        dec, pre = o[o.tokens <= 256], o[o.tokens > 256]
        rows.append(
            {
                "contender": "practical ceiling",
                "decode % floor": gm(dec.ceil_pct),
                "prefill % floor": gm(pre.ceil_pct),
                "decode, launch": float("nan"),
                "prefill, launch": float("nan"),
                "rows dropped": "--",
            }
        )
    write_text(
        gen / "table_e7.tex",
        table(
            pd.DataFrame(rows),
            "E7, tune models: geomean \\% of the physical floor over models, projections, token counts and "
            "loads, GPU time and launch-inclusive (the per-expert loop syncs with the host, so it has only "
            "the latter); rows dropped by capacity padding, summed over all cells; last row: each cell's "
            "practical ceiling, the slower of streaming its bytes and its FLOPs as one dense cuBLAS GEMM. "
            "Ours: the default path (\\texttt{grouped\\_mm}, no config), the same with its row gather "
            "timed, the tuned tile on a program per tile or on a persistent grid, and the masked layout "
            "(CUDA graphs) with TMA or pointer loads; padded: a batched GEMM over experts padded to a "
            "capacity factor.",
            "tab:e7",
            "lrrrrr",
        ),
    )
    n.add("ESevenSkewAlpha", "1.2")  # the skewed load compared with the uniform one (a setting)
    p = o.pivot_table(index=["model", "proj", "tokens"], columns="load", values="us")
    fp = o.pivot_table(index=["model", "proj", "tokens"], columns="load", values="floor_us")
    # Zipf's time over uniform's per unit of floor: a skewed decode load activates other experts than a
    # uniform one, so other weight bytes; what is left is the kernel's own penalty
    pen_floor = ((p["zipf1.2"] / p["uniform"]) / (fp["zipf1.2"] / fp["uniform"])).dropna()
    t = pen_floor.index.get_level_values("tokens")
    for phase, part in (("Decode", pen_floor[t <= 256]), ("Prefill", pen_floor[t >= 1024])):
        # each phase apart (decode T <= 256, prefill T >= 1024)
        n.add(f"ESevenSkewPenaltyFloor{phase}", gm(part))
        n.add(f"ESevenSkewPenaltyFloor{phase}Max", float(part.max()))
    path_rows = ok[ok.proj == "path(up)"].pivot_table(
        index=["model", "tokens"], columns="contender", values="graph_us"
    )
    if {"path:ours", "path:torch._grouped_mm"} <= set(path_rows.columns):
        n.add("ESevenPathSpeedup", gm(path_rows["path:torch._grouped_mm"] / path_rows["path:ours"]))
        path_t = sorted({int(t) for t in path_rows.index.get_level_values("tokens")})
        n.add("ESevenPathT", ", ".join(str(t) for t in path_t))
    if "ceil_us" in o:
        dec, pre = o[o.tokens <= 256], o[o.tokens > 256]
        n.add("ESevenCeilDecodePct", gm(dec.ceil_pct), "{:.0f}")
        n.add("ESevenOursOfCeilDecode", gm(100 * dec.ceil_us / dec.us), "{:.0f}")
        n.add("ESevenOursOfCeilPrefill", gm(100 * pre.ceil_us / pre.us), "{:.0f}")
