"""Shared helpers of the generated numbers: provenance, our default path and the seed's names; the Numbers
collection, geometric means and LaTeX tables (latex, re-exported)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from .latex import Numbers, gm, table, tex_escape  # noqa: F401  (re-exported)

# Our default path (kernel="auto": the tuned table, else the heuristic; our kernel or cuBLAS): every headline
# ratio is against it, not against the per-shape best of our kernels picked afterwards.
OURS = ["ours:auto"]


SEEDS = ("seed: optimized", "seed: original")  # the seed's Triton kernels, loaded from its own source


def commits_of(csv_path: Path) -> pd.Series | None:
    """The git_commit column of a results CSV (None if it has none), with the documented corrections of
    ``provenance_corrections.csv`` beside it applied (rows matched by file and UTC start time; the CSV
    itself is left as measured)."""
    df = pd.read_csv(csv_path, dtype={"git_commit": str})  # a hash of digits only stays a string
    if "git_commit" not in df.columns:
        return None
    commits = df["git_commit"].astype(str)
    fix = csv_path.parent / "provenance_corrections.csv"
    if fix.exists():
        for _, c in pd.read_csv(fix).iterrows():
            if c["file"] == csv_path.name:
                hit = (df["utc"].astype(str) == c["utc"]) & (commits == c["recorded_commit"])
                commits = commits.where(~hit, c["actual_commit"])
    return commits


def provenance(n: Numbers, results: Path) -> None:
    """The GPU and software the results record (from E5's rows), and the floors step's measurements and
    the datasheet peaks the floors use."""
    df = pd.read_csv(results / "decompose_k_grid.csv")
    r = df.iloc[0]
    n.add("GPU", r["gpu"])
    n.add("SMs", int(r["sm_count"]), "{}")
    n.add("Driver", str(r["driver"]))
    n.add("CudaVersion", str(r["cuda"]))
    # torch and Triton of every experiment's CSV: one pair, or each pair with the experiments it measured
    text = re.sub(r"(E\d+)-(E\d+)", r"\1--\2", versions_text(results))  # ranges as en dashes in TeX
    n.add("Versions", text.replace("_", r"\_"))
    fl = json.loads((results / "floors.json").read_text())
    n.add("TinyKernelUs", fl["measured"]["tiny_kernel_graph_us"])
    n.add("ReadTBs", fl["measured"]["read_tb_s"], "{:.2f}")
    n.add("MatmulTflops", fl["measured"]["bf16_matmul_tflops"], "{:.0f}")
    n.add("PeakTBs", fl["datasheet"]["hbm_tb_s"], "{:.1f}")
    n.add("PeakTflops", fl["datasheet"]["bf16_tflops"], "{:.0f}")


DECODE_MAX, PREFILL_MIN = 256, 1024  # the phases every headline reports apart: T <= 256, T >= 1024
CLOCKS = {"graph": "GPU time", "launch": "launch-inclusive"}


def phase_of(tokens) -> pd.Series:
    """ "decode" (T <= 256), "prefill" (T >= 1024) or "" (between: in neither headline) per token count."""
    t = pd.Series(tokens)
    phase = np.where(t <= DECODE_MAX, "decode", np.where(t >= PREFILL_MIN, "prefill", ""))
    return pd.Series(phase, index=t.index)


class Rounds(np.ndarray):
    """A cell's per-round times that also carry the cell's time as its row states it (``time``: the median
    over every sample of every round, the ``<clock>_us`` column the tables and figures show)."""

    time: float = float("nan")

    def __array_finalize__(self, obj) -> None:
        self.time = getattr(obj, "time", float("nan"))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """Arithmetic and reductions give plain arrays and floats: only a selection of the rounds (indexing,
        a mask) keeps the row's time, which arithmetic would leave standing for values it no longer fits."""
        inputs = tuple(np.asarray(x) if isinstance(x, Rounds) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(x) if isinstance(x, Rounds) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)


def round_times(row, clock: str = "graph") -> np.ndarray:
    """A result row's per-round medians on ``clock`` (its ``<clock>_round_us`` column, ';'-joined), else the
    row's one median (CSVs from before the per-round column): the values the interval resamples, as
    :class:`Rounds` carrying the row's own ``<clock>_us`` (the point :func:`cell_ratios` takes)."""
    v = float(row[f"{clock}_us"]) if f"{clock}_us" in row else float("nan")
    raw = row.get(f"{clock}_round_us") if hasattr(row, "get") else None
    vals = np.array([])
    if isinstance(raw, str) and raw.strip():
        vals = np.array([float(v) for v in raw.split(";") if v.strip()], dtype=float)
        vals = vals[np.isfinite(vals) & (vals > 0)]
    if not vals.size:
        vals = np.array([v]) if np.isfinite(v) and v > 0 else np.array([])
    out = vals.view(Rounds)
    out.time = v if np.isfinite(v) and v > 0 else (float(np.median(vals)) if vals.size else float("nan"))
    return out


def _kept_rounds(theirs: list, ours: list) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each cell's (their rounds, ours), rounds that are not finite and positive left out, and cells where
    either side has none left out."""
    pairs = [(np.asanyarray(a, float), np.asanyarray(b, float)) for a, b in zip(theirs, ours, strict=True)]
    pairs = [(a[np.isfinite(a) & (a > 0)], b[np.isfinite(b) & (b > 0)]) for a, b in pairs]
    return [(a, b) for a, b in pairs if a.size and b.size]


def _cell_time(rounds: np.ndarray) -> float:
    t = getattr(rounds, "time", float("nan"))
    return float(t) if np.isfinite(t) and t > 0 else float(np.median(rounds))


def cell_ratios(theirs: list, ours: list) -> list[float]:
    """Each cell's their time over ours (the cells ratio_ci's point is the geometric mean of): each side's
    time as its row states it where the rounds carry it (:func:`round_times`), so that a headline's point and
    the tables and figures drawn from the same rows agree; else its median round."""
    return [_cell_time(a) / _cell_time(b) for a, b in _kept_rounds(theirs, ours)]


def ratio_ci(
    theirs: list, ours: list, level: float = 0.95, n_boot: int = 4000, seed: int = 20261130
) -> tuple[float, float, float]:
    """(point, low, high): the geometric mean over cells of theirs / ours (:func:`cell_ratios`: each cell's
    time as its row states it, else its median round), and its percentile bootstrap interval at ``level``:
    cells resampled with replacement, and within each resampled cell each side's rounds resampled with
    replacement (their mean), ``n_boot`` times, from a fixed seed. ``theirs[i]``, ``ours[i]``: cell i's
    per-round times (any count >= 1; cells where either side has none are left out). A cell with one round
    per side contributes only the spread over cells. NaN triple where no cell is left."""
    pairs = _kept_rounds(theirs, ours)
    if not pairs:
        return float("nan"), float("nan"), float("nan")
    point = float(np.exp(np.mean(np.log(cell_ratios(theirs, ours)))))
    rng = np.random.default_rng(seed)
    c = len(pairs)

    def padded(side):
        n = np.array([p[side].size for p in pairs])
        m = np.full((c, n.max()), np.nan)
        for i, p in enumerate(pairs):
            m[i, : n[i]] = p[side]
        return m, n

    (ta, na), (tb, nb) = padded(0), padded(1)
    cells = rng.integers(0, c, (n_boot, c))

    def resampled_mean(m, n):
        k = m.shape[1]
        pick = (rng.random((n_boot, c, k)) * n[cells][..., None]).astype(int)
        vals = m[cells[..., None], pick]
        used = np.arange(k)[None, None, :] < n[cells][..., None]
        return np.where(used, vals, 0.0).sum(-1) / n[cells]

    logs = np.log(resampled_mean(ta, na) / resampled_mean(tb, nb)).mean(-1)
    lo, hi = np.percentile(logs, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return point, float(np.exp(lo)), float(np.exp(hi))


def is_parity(lo: float, hi: float) -> bool:
    """Whether an interval contains 1.0 (the ratio reads as parity)."""
    return bool(lo <= 1.0 <= hi)


# fewer cells than this and a bootstrap interval over cells is little more than their range: the text says
# how many ("1.52x [1.18, 2.90] over 2 cells")
FEW_CELLS = 5


def ci_text(point: float, lo: float, hi: float, cells: int | None = None) -> str:
    """A headline ratio as generated text: "1.23x [1.10, 1.35]", or "parity (0.98x [0.95, 1.02])" where the
    interval contains 1.0; "--" where there is none. A bound that rounds to 1.00 is written with three digits
    ("1.07x [1.003, 1.11]"), so that whether the interval holds 1.0 shows. ``cells``: how many cells the
    interval is over, named where fewer than FEW_CELLS."""
    if not np.isfinite(point):
        return "--"

    def bound(v: float) -> str:
        """Two digits; a bound that rounds to 1.00 but is not 1.0 gets three, rounded toward 1.0 but never to
        it (1.0031 -> 1.003, 1.0004 -> 1.001, 0.9996 -> 0.999), so that which side of 1.0 it is on shows."""
        if f"{v:.2f}" != "1.00" or v == 1.0:
            return f"{v:.2f}"
        return (
            f"{max(1.001, np.floor(v * 1000) / 1000):.3f}"
            if v > 1
            else f"{min(0.999, np.ceil(v * 1000) / 1000):.3f}"
        )

    body = f"{point:.2f}x [{bound(lo)}, {bound(hi)}]"
    if cells is not None and cells < FEW_CELLS:
        body += f" over {cells} cell{'s' if cells != 1 else ''}"
    return f"parity ({body})" if is_parity(lo, hi) else body


def ratio_ci_text(theirs: list, ours: list) -> str:
    """:func:`ci_text` of :func:`ratio_ci`, with the number of cells both sides have rounds in."""
    return ci_text(*ratio_ci(theirs, ours), cells=len(_kept_rounds(theirs, ours)))


def paired_rounds(
    df: pd.DataFrame, keys: list[str], theirs: str, ours: str, clock: str = "graph"
) -> tuple[list, list, pd.DataFrame]:
    """(their per-round times, ours, the cells) over the cells (``keys``) where both contenders have an ok
    row with a time on ``clock``."""
    ok = df[df.status == "ok"]
    a = ok[ok.contender == theirs].set_index(keys)
    b = ok[ok.contender == ours].set_index(keys)
    common = a.index.intersection(b.index)
    ta, tb, kept = [], [], []
    for key in common:
        ra, rb = round_times(a.loc[key], clock), round_times(b.loc[key], clock)
        if ra.size and rb.size:
            ta.append(ra)
            tb.append(rb)
            kept.append(key)
    cells = pd.DataFrame(kept, columns=keys) if kept else pd.DataFrame(columns=keys)
    return ta, tb, cells


def phase_ci_text(row: dict, clock: str) -> str:
    """:func:`ci_text` of a :func:`phase_headline` row's interval on ``clock``, with its cell count."""
    return ci_text(*row[clock], cells=row[f"{clock}_cells"])


def phase_headline(df: pd.DataFrame, keys: list[str], theirs: str, ours: str) -> list[dict]:
    """Per phase (decode, prefill; never pooled): their time over ours with its interval on both clocks, the
    cells, and the host cost (cpu_us medians, ours and theirs, where measured)."""
    out = []
    for phase in ("decode", "prefill"):
        sub = df[phase_of(df.tokens).to_numpy() == phase]
        row = {"phase": phase, "theirs": theirs}
        for clock in CLOCKS:
            ta, tb, cells = paired_rounds(sub, keys, theirs, ours, clock)
            row[clock] = ratio_ci(ta, tb)
            row[f"{clock}_cells"] = len(cells)
        if "cpu_us" in sub:
            ok = sub[sub.status == "ok"]
            row["host_ours_us"] = float(ok[ok.contender == ours].cpu_us.median())
            row["host_theirs_us"] = float(ok[ok.contender == theirs].cpu_us.median())
        out.append(row)
    return out


def _experiment_csvs() -> tuple[str, ...]:
    """E1..E9's CSVs: the pipeline's measurement steps, in order (experiments.pipeline.STEP_ORDER, less the
    tests, the floors and the tuners)."""
    from experiments.pipeline import STEP_ORDER

    return tuple(s for s in STEP_ORDER if s not in ("verify", "floors") and not s.startswith("tune"))


EXPERIMENT_CSVS = _experiment_csvs()  # E1..E9


def versions_text(results: Path) -> str:
    """Which torch and Triton the results used, from their CSV rows (the provenance every row carries): one
    pair, or each pair with the experiments (E1..E9) measured with it."""
    used: dict[tuple[str, str], list[int]] = {}
    for i, name in enumerate(EXPERIMENT_CSVS, 1):
        f = results / f"{name}.csv"
        if not f.exists():
            continue
        v = pd.read_csv(f, usecols=lambda c: c in ("torch", "triton"), dtype=str).dropna().drop_duplicates()
        for torch_v, triton_v in v[["torch", "triton"]].itertuples(index=False):
            used.setdefault((torch_v, triton_v), []).append(i)
    if len(used) == 1:
        (torch_v, triton_v), _ = next(iter(used.items()))
        return f"torch {torch_v}, Triton {triton_v}"
    return "; ".join(f"torch {a}, Triton {b} for {_experiments(e)}" for (a, b), e in sorted(used.items()))


def _experiments(ids: list[int]) -> str:
    runs, out = [], []
    for i in sorted(set(ids)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    for a, b in runs:
        out.append(f"E{a}" if a == b else f"E{a}, E{b}" if b == a + 1 else f"E{a}-E{b}")
    return ", ".join(out)
