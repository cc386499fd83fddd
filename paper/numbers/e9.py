"""E9 the expert layer in training, forward + backward (experiments/e9_moe_train.py): the numbers and the
table, when measured."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text
from experiments.common import load_config
from experiments.e9_moe_train import train_cells

from .common import Numbers, cell_ratios, ci_text, gm, paired_rounds, ratio_ci, table

OURS, OURS_RECOMPUTE = "ours:moe_ffn", "ours:moe_ffn:recompute"
TORCH, TORCH_COMPILED = "torch._grouped_mm pipeline", "torch._grouped_mm pipeline:compiled"
HF_COMPILED, UNSLOTH, LOOP = "hf:grouped_mm:compiled", "unsloth:grouped_gemm", "per-expert-loop"
PEERS = (TORCH, TORCH_COMPILED, HF_COMPILED, UNSLOTH)  # timed on the GPU clock (the loop: launch clock only)


def e9_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, split, tokens, load) and contender: GPU time and launch-inclusive time of the step
    (fwd+bwd), of the forward alone (fwd) and of the backward (their difference), and the step's peak
    memory; rows that failed are absent."""
    ok = df[df.status == "ok"]
    keys = ["model", "split", "tokens", "load", "contender"]
    out = None
    for phase, tag in (("fwd+bwd", "step"), ("fwd", "fwd")):
        cols = {"graph_us": f"{tag}_us", "launch_us": f"{tag}_launch_us"}
        if tag == "step":
            cols["peak_mem_bytes"] = "peak_bytes"
        part = ok[ok.phase == phase][keys + [c for c in cols if c in ok]].rename(columns=cols)
        out = part if out is None else out.merge(part, on=keys, how="outer")
    if out is None or out.empty:
        return pd.DataFrame(columns=keys)
    for c in ("step_us", "fwd_us", "step_launch_us", "fwd_launch_us", "peak_bytes"):
        if c not in out:
            out[c] = float("nan")
    out["bwd_us"] = out.step_us - out.fwd_us
    return out


def ratios(f: pd.DataFrame, peer: str, col: str) -> pd.Series:
    """Per cell, ``peer``'s ``col`` over ours (their time / ours: above 1, ours is faster or smaller)."""
    cell = ["model", "split", "tokens", "load"]
    a = f[f.contender == peer].set_index(cell)[col]
    b = f[f.contender == OURS].set_index(cell)[col]
    return (a / b).dropna()


CELL = ["model", "tokens", "load"]


def step_rows(df: pd.DataFrame) -> pd.DataFrame:
    """E9's step rows (phase fwd+bwd) plus, per cell and clock, a "best peer" row: the row of the peer
    (PEERS) fastest there on that clock, its per-round times with it (for the interval)."""
    step = df[df.phase == "fwd+bwd"]
    ok = step[(step.status == "ok") & step.contender.isin(PEERS)]
    extra = []
    for clock in ("graph", "launch"):
        live = ok[ok[f"{clock}_us"].notna()]
        if len(live):
            best = live.loc[live.groupby(CELL)[f"{clock}_us"].idxmin()].copy()
            best["best_of"] = best.contender  # which peer it was
            best["contender"] = f"best peer:{clock}"
            extra.append(best)
    return pd.concat([step, *extra], ignore_index=True) if extra else step


def interval(rows: pd.DataFrame, peer: str, clock: str) -> tuple[tuple[float, float, float] | None, int]:
    """(their step time over ours with its 95% bootstrap interval over cells and rounds, None where no cell
    has both; cells)."""
    name = f"best peer:{clock}" if peer == "best peer" else peer
    theirs, ours, cells = paired_rounds(rows, CELL, name, OURS, clock)
    return (ratio_ci(theirs, ours), len(cells)) if len(cells) else (None, 0)


def best_backward(held: pd.DataFrame, peers: list[str]) -> pd.Series:
    """Per held-out cell, the fastest peer's backward (GPU time) over ours (a peer whose step never captured
    has no GPU time: no part in it)."""
    cell = ["model", "split", "tokens", "load"]
    pb = held.pivot_table(index=cell, columns="contender", values="bwd_us")
    if OURS not in pb:
        return pd.Series(dtype=float)
    return (pb.reindex(columns=peers).min(axis=1) / pb[OURS]).dropna()


def peer_rows(raw: pd.DataFrame, held: pd.DataFrame, n: Numbers | None = None) -> list[dict]:
    """Per peer of the held-out rows and the best peer: the step's time over ours on both clocks with
    intervals, cells, and (per peer) the backward alone and the peak memory over ours; the best peer's
    intervals also as the paper's headline macros where ``n`` is given."""
    rows = step_rows(raw[raw.split == "heldout"])
    peers = [p for p in PEERS if (held.contender == p).any()]
    table_rows = []
    for peer in ["best peer", *peers] if peers else []:
        line, count = {"peer": peer}, 0
        for clock, ct, label in (("graph", "Gpu", "GPU time"), ("launch", "Launch", "launch-inclusive")):
            ci, cells = interval(rows, peer, clock)
            line[label] = ci_text(*ci) if ci else "--"  # the table has a cells column
            if cells and peer == "best peer" and n is not None:  # the headline; each peer's is in the table
                n.add(f"ENineHeldVsPeer{ct}", ci_text(*ci, cells=cells))
            count = count or cells
        line["cells"] = count
        if peer != "best peer":
            line["backward (GPU)"] = gm(ratios(held, peer, "bwd_us"))
            line["peak memory"] = gm(ratios(held, peer, "peak_bytes"))
        else:  # the fastest peer's backward per cell (the memory is each peer's own: no best)
            rb = best_backward(held, peers)
            line["backward (GPU)"] = gm(rb) if len(rb) else float("nan")
            line["peak memory"] = float("nan")
        table_rows.append(line)
    return table_rows


def model_experts(raw: pd.DataFrame) -> dict[str, int]:
    """Each held-out model's routed experts: the CSV's ``experts`` column, else the zoo's (config.yaml)."""
    held = raw[raw.split == "heldout"]
    if "experts" in held:
        return {m: int(e) for m, e in held.groupby("model").experts.first().items()}
    zoo = load_config()["grouped"]["models"]
    return {m: int(zoo[m]["experts"]) for m in held.model.unique() if m in zoo}


def per_model_text(raw: pd.DataFrame, rows: pd.DataFrame) -> str:
    """Per held-out model (fewest experts first), the best peer's step time over ours on the GPU clock with
    its interval over the model's cells and rounds (``rows``: the held-out split's step_rows), as plain
    text: "phi-3.5-moe (16 experts) parity (1.01x [0.98, 1.04]); olmoe-1b-7b (64 experts) 1.05x [1.02,
    1.08]"."""
    experts = model_experts(raw)
    parts = []
    for model in sorted(rows.model.unique(), key=lambda m: (experts.get(m, 0), m)):
        ci, cells = interval(rows[rows.model == model], "best peer", "graph")
        if cells:
            text = ci_text(*ci, cells=cells)
            size = f" ({experts[model]} experts)" if model in experts else ""
            parts.append(f"{model}{size} {text}")
    return "; ".join(parts) if parts else "--"


def coverage(n: Numbers, raw: pd.DataFrame) -> None:
    """``ENineCoverage``: coverage_text."""
    n.add("ENineCoverage", coverage_text(raw))


# each peer as the prose names it
PEER_NAMES = {
    TORCH: "the torch._grouped_mm pipeline",
    TORCH_COMPILED: "the compiled pipeline",
    HF_COMPILED: "transformers' compiled backend",
    UNSLOTH: "Unsloth's kernels",
}


# each peer as the table names it (short enough for the table to fit the text width)
TABLE_NAMES = {
    TORCH: "torch pipeline",
    TORCH_COMPILED: "torch pipeline, compiled",
    HF_COMPILED: "transformers, compiled",
    UNSLOTH: "Unsloth",
}


def coverage_text(raw: pd.DataFrame) -> str:
    """What of the pipeline's E9 selection (config.yaml's moe_train.run) the committed run holds, as one
    clause of plain text: the cells measured of those planned (and the models with no row); the peers that ran
    on some of the models only; the cells whose step has no GPU time for ours (its graph capture failed:
    launch clock only) and the peers whose step has no GPU time in any cell."""
    cfg = load_config()
    planned = train_cells(cfg["grouped"], cfg["moe_train"], 141 << 30)
    models = list(dict.fromkeys(m for m, _, _ in planned))
    steps = raw[(raw.phase == "fwd+bwd") & (raw.status == "ok")]
    step = steps[steps.contender == OURS]
    done = {(m, int(t), ld) for m, t, ld in zip(step.model, step.tokens, step.load)}
    measured = len(done & set(planned))
    missing = sorted(set(models) - set(raw.model))
    if measured == len(planned):
        parts = [f"{len(planned)} cells"]
    else:
        parts = [f"{measured} of {len(planned)} planned cells"]
        if missing:
            parts[0] += f" (no row of {', '.join(missing)})"
    no_graph = int(step.graph_us.isna().sum())
    if no_graph:
        parts.append(f"ours has the launch clock only in {no_graph} cell{'s' if no_graph > 1 else ''}")
    for p in PEERS:  # a peer that ran on some models only, or without GPU time: one clause each
        ran = [m for m in models if (raw[raw.contender == p].model == m).any()]
        some = bool(ran) and len(ran) < len(models) - len(missing)
        clock = (steps.contender == p).any() and steps[steps.contender == p].graph_us.isna().all()
        said = [f"ran on {', '.join(ran)} alone"] if some else []
        said += ["launch clock only (no CUDA graph captured its step)"] if clock else []
        if said:
            parts.append(f"{PEER_NAMES[p]} {', '.join(said)}")
    return "; ".join(parts)


def e9(n: Numbers, results: Path, gen: Path) -> None:
    """E9's numbers, held-out models (every training step is prefill-sized: T >= 1024): per peer and the
    best peer, the step's time over ours on both clocks with intervals, the backward's alone and the peak
    memory (geomeans); keeping the gate/up product against recomputing it; the table."""
    path = results / "moe_train.csv"
    raw = pd.read_csv(path) if path.exists() else None
    f = e9_frame(raw) if raw is not None else None
    measured = f is not None and not f.empty and (f.contender == OURS).any()
    n.add("ENineMeasured", int(measured), "{}")  # the paper's E9 parts are \ifnum\ENineMeasured=1
    if not measured:
        return
    held = f[f.split == "heldout"]
    n.add("ENineHeldModels", held.model.nunique(), "{}")
    experts = sorted(set(model_experts(raw).values()))
    n.add("ENineExperts", " and ".join(str(e) for e in experts) or "--")
    coverage(n, raw)
    steps = step_rows(raw[raw.split == "heldout"])  # with the best peer of each cell and clock
    n.add("ENinePerModel", per_model_text(raw, steps))
    n.add("ENineTokens", ", ".join(str(int(t)) for t in sorted(held.tokens.unique())))
    peers = [p for p in PEERS if (held.contender == p).any()]
    table_rows = peer_rows(raw, held, n)
    if peers:
        rb = best_backward(held, peers)
        if len(rb):
            n.add("ENineHeldBwdVsPeer", gm(rb))
        # per cell the intervals' point estimate (the cell's best peer), so that the lowest cell is never
        # above the geomean of any set of cells that holds it
        r = pd.Series(cell_ratios(*paired_rounds(steps, CELL, "best peer:graph", OURS, "graph")[:2]))
        if len(r):
            n.add("ENineHeldVsPeerMin", f"{r.min():.2f}")
    mem = ratios(held, TORCH, "peak_bytes")
    if len(mem):
        n.add("ENineMemVsTorch", gm(mem))
    recompute = ratios(held, OURS_RECOMPUTE, "step_us")
    if len(recompute):
        n.add("ENineRecomputeOverSave", gm(recompute))
    if table_rows:
        write_text(
            gen / "table_e9.tex",
            table(
                pd.DataFrame(table_rows).replace({"peer": TABLE_NAMES}),
                "E9, held-out models: each peer's forward + backward time over ours, geomean over cells "
                "(model, $T$, load) with its 95\\% bootstrap interval over cells and rounds, on both clocks "
                "(``parity'' where it holds 1.0); the best peer is the fastest peer per cell and clock; "
                "then the backward alone (GPU time) and the step's peak memory, their value over ours "
                "(geomean; above 1: ours is faster or smaller). The torch pipeline is the "
                "\\texttt{torch.\\_grouped\\_mm} one; transformers' is its \\texttt{grouped\\_mm} experts "
                "backend.",
                "tab:e9",
                "lllrrr",
                colsep=4,
            ),
        )
