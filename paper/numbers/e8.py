"""E8 the expert FFN end to end (experiments/e8_moe_layer.py): the numbers and the table, when measured."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text
from moegemm.grouped.ffn import FUSE_ABOVE_ROWS_PER_EXPERT

from .common import CLOCKS, Numbers, gm, phase_ci_text, phase_headline, table

OURS, UNFUSED = "ours:moe_ffn", "ours:unfused-swiglu"
HF_COMPILED, TORCH, VLLM = "hf:grouped_mm:compiled", "torch._grouped_mm pipeline", "vllm:fused_experts"
TK = "tk:matmul_ogs"  # OpenAI's triton_kernels as vLLM runs it for gpt-oss (triton_kernels_moe.py)
PEERS = (HF_COMPILED, TORCH, VLLM, TK)  # the best peer of a cell: the fastest of these there
BEST = "best peer"
KEYS = ["model", "tokens", "load"]
OURS_HF, OURS_HF_COMPILED = "ours:hf-backend", "ours:hf-backend:compiled"
PREFILL = 1024


def e8_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, split, tokens, load): each contender's GPU time as a column (rows that failed: absent),
    ``best_peer``, the fastest of transformers' compiled grouped_mm backend (where measured), the
    torch._grouped_mm pipeline, vLLM's fused_experts and triton_kernels (where at hand), and ``fused``:
    whether moe_ffn fuses SwiGLU into gate/up there (more than
    FUSE_ABOVE_ROWS_PER_EXPERT rows per expert on average)."""
    ok = df[df.status == "ok"]
    index = ["model", "split", "tokens", "load"] + [c for c in ("experts", "top_k") if c in df]
    p = ok.pivot_table(index=index, columns="contender", values="graph_us")
    peers = [c for c in PEERS if c in p]
    p["best_peer"] = p[peers].min(axis=1) if peers else float("nan")
    p = p.reset_index()
    if "experts" in p and "top_k" in p:
        p["fused"] = p.tokens * p.top_k > FUSE_ABOVE_ROWS_PER_EXPERT * p.experts
    else:
        p["fused"] = True
    return p


def ffn_ceiling_probe(n: Numbers, results: Path) -> None:
    """probes/probe_ffn_ceiling.py (when its CSV is committed): on the held-out models' largest cells, ours
    over dense:ffn (the FFN's two GEMMs as dense cuBLAS GEMMs with one expert's weights, nothing else): its
    range over the cells, and the cells measured."""
    path = results / "probe_ffn_ceiling.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df[df.status == "ok"].pivot_table(
        index=["model", "tokens", "load"], columns="contender", values="graph_us"
    )
    dense = "dense:ffn"
    if not all(c in p for c in (OURS, dense)):
        return
    ours = (p[OURS] / p[dense]).dropna()
    n.add("EEightCeilCells", len(ours), "{}")
    n.add("EEightCeilOursVsDenseLo", float(ours.min()))
    n.add("EEightCeilOursVsDenseHi", float(ours.max()))


def host_probe(n: Numbers, results: Path) -> None:
    """probes/probe_host_cost.py: the host's time per moe_ffn call (range over the cells), how much less it
    is than with every kernel launched through Triton's own launcher (measured in alternating rounds)."""
    path = results / "probe_host_cost.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    p = df.pivot_table(index=["model", "tokens"], columns="contender", values="cpu_us")
    ours, plain = "moe_ffn", "moe_ffn:triton-launch"
    if ours not in p or plain not in p:
        return
    n.add("EEightHostUsMin", float(p[ours].min()), "{:.0f}")
    n.add("EEightHostUsMax", float(p[ours].max()), "{:.0f}")
    n.add("EEightHostGain", gm(p[plain] / p[ours]))


def fusion_ratios(o: pd.DataFrame) -> pd.Series:
    """Our unfused time over moe_ffn's, per cell where moe_ffn may fuse (above FUSE_ABOVE_ROWS_PER_EXPERT rows
    per expert; at decode it runs the unfused product itself)."""
    fo = o[o.fused]
    return (fo[UNFUSED] / fo[OURS]).dropna()


def with_best_peer(df: pd.DataFrame) -> pd.DataFrame:
    """E8's rows plus, per cell and clock, a ``best peer`` row: the row of the peer (PEERS) fastest there on
    that clock (its per-round times travel with it, for the interval)."""
    ok = df[(df.status == "ok") & df.contender.isin(PEERS)]
    extra = []
    for clock in CLOCKS:
        col = f"{clock}_us"
        if col not in ok:
            continue
        live = ok[ok[col].notna()]
        if live.empty:
            continue
        best = live.loc[live.groupby(KEYS)[col].idxmin()].copy()
        best["best_of"] = best.contender  # which peer it was
        best["contender"] = f"{BEST}:{clock}"
        extra.append(best)
    return pd.concat([df, *extra], ignore_index=True) if extra else df


def phase_rows(df: pd.DataFrame) -> list[dict]:
    """Per peer (the best peer, then each peer measured) and phase: their time over moe_ffn's with its 95%
    interval on both clocks, and the host cost; the best peer taken per clock."""
    d = with_best_peer(df)
    out = []
    for peer in (BEST, *PEERS):
        if peer == BEST:
            rows = {}
            for clock in CLOCKS:
                for r in phase_headline(
                    d[d.contender.isin([OURS, f"{BEST}:{clock}"])].replace({f"{BEST}:{clock}": BEST}),
                    KEYS,
                    BEST,
                    OURS,
                ):
                    rows.setdefault(r["phase"], {"phase": r["phase"], "theirs": BEST}).update(
                        {clock: r[clock], f"{clock}_cells": r[f"{clock}_cells"]}
                    )
            out += list(rows.values())
        elif peer in set(d.contender):
            out += phase_headline(d, KEYS, peer, OURS)
    return [r for r in out if any(r.get(f"{c}_cells") for c in CLOCKS)]


def phase_numbers(n: Numbers, held: pd.DataFrame) -> None:
    """The E8 headline, held-out models, both clocks with intervals (text, "parity" where the interval holds
    1.0): against the best peer per phase (EEightHeld<Phase>VsPeer<Gpu|Launch>), against the
    torch._grouped_mm pipeline at decode and vLLM's fused_experts at prefill (the same two clocks)."""
    rows = {(r["theirs"], r["phase"]): r for r in phase_rows(held)}
    for phase in ("decode", "prefill"):
        r = rows.get((BEST, phase), {})
        for clock, ct in (("graph", "Gpu"), ("launch", "Launch")):
            if r.get(f"{clock}_cells"):
                n.add(f"EEightHeld{phase.capitalize()}VsPeer{ct}", phase_ci_text(r, clock))
    for peer, phase, name in (
        (TORCH, "decode", "EEightHeldDecodeVsTorch"),
        (VLLM, "prefill", "EEightHeldPrefillVsVllm"),
    ):
        r = rows.get((peer, phase), {})
        for clock, ct in (("graph", "Gpu"), ("launch", "Launch")):
            if r.get(f"{clock}_cells"):
                n.add(name + ct, phase_ci_text(r, clock))
    # the host's time per call as E8 measured it (cpu_us, median over the phase's cells): ours and vLLM's
    for phase in ("decode", "prefill"):
        r = rows.get((VLLM, phase), {})
        if "host_ours_us" in r and pd.notna(r["host_ours_us"]) and pd.notna(r["host_theirs_us"]):
            n.add(f"EEightHost{phase.capitalize()}OursUs", r["host_ours_us"], "{:.0f}")
            n.add(f"EEightHost{phase.capitalize()}VllmUs", r["host_theirs_us"], "{:.0f}")


# each peer as the prose names it
PEER_NAMES = {
    HF_COMPILED: "transformers' compiled backend",
    TORCH: "the torch._grouped_mm pipeline",
    VLLM: "vLLM's fused_experts",
    TK: "triton_kernels",
}


def fastest_numbers(n: Numbers, held: pd.DataFrame) -> None:
    """The peer most often the best peer (with_best_peer's choice per cell), per phase, on the GPU clock, as
    plain text (EEight<Phase>FastestGpu: "vLLM's fused_experts (5 of 7 cells)")."""
    d = with_best_peer(held)
    best = d[d.contender == f"{BEST}:graph"]
    for phase, part in (("Decode", best[best.tokens <= 256]), ("Prefill", best[best.tokens >= PREFILL])):
        counts = part.best_of.value_counts()
        if not counts.empty:
            n.add(f"EEight{phase}FastestGpu", most_often(counts, len(part)))


def most_often(counts: pd.Series, cells: int) -> str:
    """The peer that is the best peer in the most cells, from ``counts`` (cells per peer, most first), as
    text: "vLLM's fused_experts (5 of 7 cells)"; peers tied for the most are all named, in name order:
    "triton_kernels or vLLM's fused_experts (2 of 5 cells each)"."""
    k = int(counts.max())
    tied = sorted(PEER_NAMES[p] for p in counts[counts == k].index)
    return f"{' or '.join(tied)} ({k} of {cells} cells{' each' if len(tied) > 1 else ''})"


def gemm_vs_layer(n: Numbers, results: Path, held: pd.DataFrame) -> None:
    """vLLM's GEMMs alone (E7, held-out: its kernel's gate/up plus down time over ours, ours with the gather
    timed where E7 has it, ``ours:auto+gather``, else ``ours:auto``) against its whole layer (E8) on the same
    cells (model, T, load) at prefill: how much of the layer ratio is the GEMMs'. Macros
    EEightVllmGemmOnlyPrefill, EEightVllmLayerPrefill."""
    path = results / "grouped_skew.csv"
    if not path.exists() or VLLM not in held:
        return
    e7 = pd.read_csv(path)
    e7 = e7[(e7.status == "ok") & (e7.split == "heldout")] if "split" in e7 else e7.iloc[:0]
    ours = "ours:auto+gather" if (e7.contender == "ours:auto+gather").any() else "ours:auto"
    g = e7[e7.contender.isin([ours, "vllm:fused_moe"]) & e7.proj.isin(["up", "down"])]
    if g.empty:
        return
    per = g.pivot_table(index=KEYS, columns=["contender", "proj"], values="graph_us")
    need = [(c, pr) for c in (ours, "vllm:fused_moe") for pr in ("up", "down")]
    if not all(k in per.columns for k in need):
        return
    gemm = (
        (per[("vllm:fused_moe", "up")] + per[("vllm:fused_moe", "down")])
        / (per[(ours, "up")] + per[(ours, "down")])
    ).dropna()
    layer = (held.set_index(KEYS)[VLLM] / held.set_index(KEYS)[OURS]).dropna()
    both = gemm.index.intersection(layer.index)
    idx = [k for k in both if k[1] >= PREFILL]
    if idx:
        n.add("EEightVllmGemmOnlyPrefill", gm(gemm.loc[idx]))
        n.add("EEightVllmLayerPrefill", gm(layer.loc[idx]))


def e8(n: Numbers, results: Path, gen: Path) -> None:
    path = results / "moe_layer.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)
    o = e8_frame(df)
    if o.empty or OURS not in o:
        return
    held = o[o.split == "heldout"]
    n.add("EEightFuseAbove", FUSE_ABOVE_ROWS_PER_EXPERT, "{}")
    # how E8's vLLM layer took its config: searched as E7's kernel (rows with vllm_search_us), or vLLM's own
    v = df[(df.contender == VLLM) & (df.status == "ok")]
    searched = "vllm_search_us" in v and v.vllm_search_us.notna().any()
    n.add(
        "EEightVllmConfig",
        "in E8 likewise, one config for both GEMMs" if searched else "in E8 at vLLM's own config, unsearched",
        "{}",
    )
    r = (held.set_index(KEYS).best_peer / held.set_index(KEYS)[OURS]).dropna()
    t = r.index.get_level_values("tokens")
    for phase, part in (("Decode", r[t <= 256]), ("Prefill", r[t >= PREFILL])):  # each phase apart
        if len(part):
            n.add(f"EEight{phase}VsPeerMin", float(part.min()))
            n.add(f"EEight{phase}SlowerPeer", int((part < 1).sum()), "{}")
            n.add(f"EEight{phase}PeerCells", len(part), "{}")
    held_rows = df[df.split == "heldout"] if "split" in df else df.iloc[:0]
    phase_numbers(n, held_rows)
    fastest_numbers(n, held_rows)
    gemm_vs_layer(n, results, held)
    if UNFUSED in o:
        f = fusion_ratios(o)
        if len(f):
            n.add("EEightFusionGain", gm(f))
    ffn_ceiling_probe(n, results)
    host_probe(n, results)
    rows = []
    for model, m in held.groupby("model", sort=False):
        row = {"model": model}
        for phase, part in (("decode", m[m.tokens <= 256]), ("prefill", m[m.tokens >= PREFILL])):
            r = (part.best_peer / part[OURS]).dropna()
            row[f"{phase} vs best peer"] = f"{gm(r):.2f} ({r.min():.2f})" if len(r) else "--"
        if VLLM in m:
            pm = m[m.tokens >= PREFILL]
            row["prefill vs vLLM"] = f"{gm(pm[VLLM] / pm[OURS]):.2f}"
        if UNFUSED in m and m.fused.any():
            mf = m[m.fused]
            row["fused SwiGLU gain"] = f"{gm(mf[UNFUSED] / mf[OURS]):.2f}"
        rows.append(row)
    if rows:
        write_text(
            gen / "table_e8.tex",
            table(
                pd.DataFrame(rows),
                "E8, held-out models: the whole expert FFN (\\texttt{moe\\_ffn}) against the best peer of "
                "each cell (the fastest of the \\texttt{torch.\\_grouped\\_mm} pipeline, vLLM's "
                "\\texttt{fused\\_experts}, \\texttt{triton\\_kernels} and, where measured, transformers' "
                "compiled \\texttt{grouped\\_mm} backend) at decode ($T \\le 256$) and prefill ($T \\ge "
                f"{PREFILL}$), each apart, and against vLLM's at prefill; their time over ours, geomean "
                "(lowest) over the model's cells of that phase; GPU time. Last column: our time with SwiGLU "
                f"as a separate op over the fused one, where \\texttt{{moe\\_ffn}} fuses (above "
                f"{FUSE_ABOVE_ROWS_PER_EXPERT} rows per expert).",
                "tab:e8",
                "l" + "r" * (len(rows[0]) - 1),
            ),
        )
