"""E7 on the held-out models (config.yaml's zoo, split "heldout": shapes neither the tuner nor the distilled
default saw): the default path as a user gets it (``ours:auto``) against torch._grouped_mm and vLLM's kernel,
per projection and cell; the grouped headline."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments._io import write_text

from .common import Numbers, gm, table

AUTO, DEFAULT, TORCH, VLLM = "ours:auto", "ours:default", "torch._grouped_mm", "vllm:fused_moe"
GATHER = "ours:auto+gather"  # ours:auto with its gather of the rows timed: the work of vLLM's kernel
PREFILL = 1024  # T >= this: prefill; T <= 256: decode


def heldout_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per held-out (model, proj, tokens, load): ours:auto's time (``us``), % of floor, first-call seconds and
    config source; ours:default's time (``def_us``); ours:auto with its row gather timed (``ga_us``, the
    work of vLLM's kernel, which gathers its rows itself: ours over vLLM's is taken with it);
    torch._grouped_mm's (``tg_us``, ``tg_pct``); vLLM's (``vl_us``, ``vl_pct``) where measured. Empty where
    E7 has no held-out rows."""
    if "split" not in df:
        return pd.DataFrame()
    g = df[(df.split == "heldout") & (df.status == "ok")]
    key = ["model", "proj", "tokens", "load"]
    a = g[g.contender == AUTO].set_index(key)
    if a.empty:
        return pd.DataFrame()
    out = pd.DataFrame(
        {
            "us": a.graph_us,
            "pct": a.pct_floor_graph,
            "experts": a.experts,
            "top_k": a.top_k,
            "k": a.k,
            "n": a.n,
            "source": a.config_source,
            "first_call_s": a.get("first_call_s", pd.Series(float("nan"), index=a.index)),
        }
    )
    for c, us, pct in (
        (DEFAULT, "def_us", None),
        (GATHER, "ga_us", None),
        (TORCH, "tg_us", "tg_pct"),
        (VLLM, "vl_us", "vl_pct"),
    ):
        sub = g[g.contender == c].set_index(key)
        if len(sub):
            out[us] = sub.graph_us
            if pct:
                out[pct] = sub.pct_floor_graph
    return out.reset_index()


def distill_numbers(n: Numbers, results: Path) -> None:
    """The distilled default scored leave one tune model out (experiments/distill_grouped.py's CSV): what the
    best of the shortlist loses against the tuner's best (geomean over the cells)."""
    path = results / "distill_grouped.csv"
    if not path.exists():
        return
    from experiments.distill_grouped import SHORTLIST

    d = pd.read_csv(path)
    n.add("ShortlistSize", SHORTLIST, "{}")  # the configs a new shape's first call times (a setting)
    n.add("LooCells", len(d), "{}")
    n.add("LooShort", gm(d.shortlist_slowdown))


def vllm_work(o: pd.DataFrame) -> pd.Series:
    """Our time on vLLM's kernel's work: with the row gather timed where measured (``ga_us``), else ``us``."""
    return o.ga_us.fillna(o.us) if "ga_us" in o else o.us


def _gm_low(r: pd.Series) -> str:
    """Ratios as the held-out table gives them: "geomean (lowest)"."""
    return f"{gm(r):.2f} ({r.min():.2f})"


def _ts(o: pd.DataFrame, sel) -> str:
    """The token counts of the rows ``sel`` picks, as "16, 256"."""
    return ", ".join(str(int(t)) for t in sorted(o[sel].tokens.unique()))


def e7_heldout(n: Numbers, results: Path, gen: Path) -> None:
    distill_numbers(n, results)
    path = results / "grouped_skew.csv"
    if not path.exists():
        return
    raw = pd.read_csv(path)
    o = heldout_frame(raw)
    if o.empty:
        return
    from .e7 import e7_phase_numbers  # per phase, both clocks, 95% intervals: HeldSeven<Phase>Vs<Peer><Clock>

    e7_phase_numbers(n, raw[raw.split == "heldout"], prefix="HeldSeven", tags=("Torch", "Vllm", "Tk"))
    n.add("HeldModels", o.model.nunique(), "{}")
    from experiments.common import load_config

    zoo = load_config()["grouped"]["models"]
    n.add("ZooHeldModels", sum(m["split"] == "heldout" for m in zoo.values()), "{}")  # the zoo's, config.yaml
    for tag, sel in (("Prefill", o.tokens >= PREFILL), ("Decode", o.tokens <= 256)):
        c = o[sel]
        n.add(f"Held{tag}T", _ts(o, sel))  # the phase's T
        n.add(f"Held{tag}Pct", gm(c.pct), "{:.0f}")
        n.add(f"Held{tag}TorchPct", gm(c.tg_pct), "{:.0f}")
    # the spread between models, which the headline's interval (cells resampled) does not show: per model,
    # torch._grouped_mm's time over ours at prefill, geomean over its cells: the highest and whose it is,
    # and the others' range
    pre = o[o.tokens >= PREFILL]
    per_model = pre.groupby("model").apply(lambda m: gm(m.tg_us / m.us), include_groups=False).dropna()
    if len(per_model) > 1:
        n.add("HeldPrefillTorchModelHi", float(per_model.max()))
        n.add("HeldPrefillTorchModelTop", str(per_model.idxmax()), "{}")
        rest = per_model.drop(per_model.idxmax())
        n.add("HeldPrefillTorchRestLo", float(rest.min()))
        n.add("HeldPrefillTorchRestHi", float(rest.max()))
    first = o[o.source == "autotuned on this call"].first_call_s.astype(float)
    if len(first):
        n.add(
            "HeldAutotuneText",
            f"a new shape's first call took {float(first.median()):.1f} s in the median",
            "{}",
        )
    elif "first_call_s" in o:  # every first call found its choice in the disk cache of an earlier process
        ms = 1e3 * float(o.first_call_s.astype(float).median())
        n.add(
            "HeldAutotuneText",
            f"the measured first calls hit the on-disk autotuning cache (median {ms:.1f} ms), so a new "
            "shape's tuning time is not measured here",
            "{}",
        )
    rows = []
    for model, m in o.groupby("model", sort=False):
        pm, dm = m[m.tokens >= PREFILL], m[m.tokens <= 256]
        row = {
            "model": model,
            "E / top-k": f"{int(m.experts.iloc[0])} / {int(m.top_k.iloc[0])}",
            "decode vs torch": _gm_low(dm.tg_us / dm.us),
            "prefill vs torch": _gm_low(pm.tg_us / pm.us),
        }
        if "vl_us" in m:  # both phases (at decode vLLM's kernel is the faster in some cells), the same work
            row["decode vs vLLM"] = _gm_low(dm.vl_us / vllm_work(dm))
            row["prefill vs vLLM"] = _gm_low(pm.vl_us / vllm_work(pm))
        row["prefill % floor"] = f"{gm(pm.pct):.0f}"
        rows.append(row)
    write_text(
        gen / "table_e7_heldout.tex",
        table(
            pd.DataFrame(rows),
            "E7, held-out models (never tuned on): the default path against "
            "\\texttt{torch.\\_grouped\\_mm} (on rows already permuted) and vLLM's kernel (ours with its "
            "gather of the rows timed, as vLLM's gathers them), their time over ours, geomean (lowest) "
            "over both projections, the loads measured, and decode "
            f"($T$ = {_ts(o, o.tokens <= 256)}) or prefill "
            f"($T$ = {_ts(o, o.tokens >= PREFILL)}); GPU time. Last column: our \\% of the floor at "
            "prefill.",
            "tab:e7heldout",
            "ll" + "r" * (len(rows[0]) - 2),
        ),
    )
