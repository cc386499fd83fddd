"""E9 moe-train: the expert layer of an MoE model in training, forward plus backward.

Per zoo model (config.yaml's grouped.models, tune and held-out, weights as E8's: gate_up [E, 2I, H], down
[E, H, I], bf16), tokens per step T (moe_train.tokens, where the layer fits in memory: see ``fits``) and
load (uniform, Zipf 1.2): one step is the layer's forward on x [T, H] with the router's top-k ids and
gating weights, then the backward of a fixed upstream gradient dY, computing the gradients of x, the gating
weights (the router learns) and both weights. Contenders:

- ``ours:moe_ffn``: moegemm.grouped.moe_ffn as it comes (the [rows, 2I] gate/up product kept from the
  forward, its gradient written over it in the backward); ``ours:moe_ffn:recompute``: the same recomputing
  the gate/up product in the backward instead (``save_gate_up=False``);
- ``torch._grouped_mm pipeline`` (torchtitan's path): routing, the permutation as a gather, torch._grouped_mm
  for gate/up, SiLU * up, torch._grouped_mm for down, the gating weights and a scatter-add back to the
  tokens, all torch ops with torch's autograd; eager, and ``...:compiled`` under torch.compile;
- ``hf:grouped_mm:compiled``: transformers' grouped_mm experts backend (Qwen3-MoE's experts module over the
  cell's weights, as E8 runs it), under torch.compile;
- ``unsloth:grouped_gemm``: Unsloth's Triton MoE kernels with their own backward, loaded at run time from
  their source (MOEGEMM_UNSLOTH_SOURCE; experiments/unsloth_moe.py; the revision in the row), as Unsloth's
  training runs them: configs from Unsloth's own tuner, run once per layer shape by the pipeline's
  tune_unsloth step (results/<slug>/tune_unsloth.csv, as Unsloth's disk cache serves a machine's later runs;
  where that file lacks the shape, the first call tunes, inside the contender's setup time; the row's
  config and config_source say which);
- ``per-expert-loop``: transformers' eager experts (a loop over the experts hit; host syncs: launch clock
  only).

Each phase in moe_train.phases is its own row: "fwd+bwd" (the step; its output, dX, checked against a
float64 dX, and the gradients of the gating weights and of both weights, expert by expert, against float64
too, before anything is timed) and "fwd" (the forward alone with autograd recording, checked against the
float64 output);
the backward's time is their difference. Both clocks (GPU time through a CUDA graph where the contender
captures, and launch-inclusive), and the peak memory of one step (``peak_mem_bytes``:
torch.cuda.max_memory_allocated over the step; ``step_mem_bytes``: that less what was allocated before it).

    python -m experiments.e9_moe_train --out results/<slug>/moe_train.csv
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from experiments import unsloth_moe
from experiments.common import ROOT, Progress, check_models, raise_recompile_limit, selected, shard_cells
from experiments.e7_grouped_skew import failed_contender, graph_rates, start
from experiments.e8_moe_layer import annotate, ffn_weights, hf_experts, layer_sizes
from experiments.harness.correctness import check
from experiments.harness.moe_loads import sample_topk
from experiments.harness.runner import Contender, measure
from moegemm.grouped import moe_ffn, route

CELL_KEYS = ("model", "tokens", "load")
PHASES = ("fwd+bwd", "fwd")


def _expert_terms(e: int, x, ids, wts, w_gu, w_dn, dy) -> dict | None:
    """Expert ``e``'s part of the layer and of dY's backward in float64 (its weights in float64 alone), or
    None where it has no rows: its tokens and slots (tok, j), rows x_e, dY_e, gating weights s, SiLU(g) * u
    (act), the gate and up products' gradients (dg, du) and its weights."""
    tok, j = torch.nonzero(ids == e, as_tuple=True)
    if tok.numel() == 0:
        return None
    i = w_gu.shape[1] // 2
    gu_w, dn_w = w_gu[e].double(), w_dn[e].double()  # [2I, H], [H, I]
    xe, dye = x[tok].double(), dy[tok].double()
    h = xe @ gu_w.T
    g, u = h[:, :i], h[:, i:]
    sg = torch.sigmoid(g)
    act = g * sg * u
    s = wts[tok, j].double()[:, None]
    da = s * (dye @ dn_w)
    dg = da * u * sg * (1 + g * (1 - sg))
    du = da * g * sg
    # magnitudes: what each term's rounding errors scale with (its sums of absolute products), for the
    # error bound of the gradients built from them (check_weight_grads); |SiLU| <= |g|, |SiLU'| <= 1.1
    hm = xe.abs() @ gu_w.abs().T
    gm, um = hm[:, :i], hm[:, i:]
    dam = s.abs() * (dye.abs() @ dn_w.abs())
    mags = dict(act=2.1 * gm * um, dgu=torch.cat([1.1 * dam * um, dam * gm], 1))
    return dict(
        tok=tok, j=j, xe=xe, dye=dye, s=s, act=act, dgu=torch.cat([dg, du], 1), gu_w=gu_w, dn_w=dn_w, mag=mags
    )


@torch.no_grad()
def ref_step(x, ids, wts, w_gu, w_dn, dy) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (y [T, H], dX [T, H]) of the layer and of dY's backward, expert by expert (each expert's
    weights in float64 one at a time)."""
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    dx = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        t = _expert_terms(e, x, ids, wts, w_gu, w_dn, dy)
        y.index_add_(0, t["tok"], t["s"] * (t["act"] @ t["dn_w"].T))
        dx.index_add_(0, t["tok"], t["dgu"] @ t["gu_w"])
    return y, dx


def torch_pipeline_train(x, ids, wts, w_gu, w_dn, e: int) -> torch.Tensor:
    """torchtitan's MoE path in torch ops (differentiable): routing (ours: no host sync), the permutation as
    a gather, torch._grouped_mm for gate/up, SiLU * up, torch._grouped_mm for down, the gating weights in
    fp32 and a scatter-add back to the tokens."""
    plan = route(ids, e, validate=False)
    offs = plan.group_offsets[1:].to(torch.int32)
    xs = x.index_select(0, plan.sorted_token_ids)
    gu = torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offs)
    i = gu.shape[1] // 2
    act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    ys = torch._grouped_mm(act, w_dn.transpose(1, 2), offs=offs)
    ws = wts.reshape(-1).index_select(0, plan.sorted_slot)
    ys = (ys.float() * ws[:, None]).to(x.dtype)
    idx = plan.sorted_token_ids.to(torch.int64)[:, None].expand(-1, x.shape[1])
    return torch.zeros_like(x).scatter_add(0, idx, ys)


def check_weight_grads(got, x, ids, wts, w_gu, w_dn, dy, scale: float = 1.0) -> tuple[bool, float, str]:
    """The step's other gradients against float64, expert by expert (each expert's weights in float64 one
    at a time, as ref_step): ``got`` = (d wts [T, k], dW_gu [E, 2I, H], dW_dn [E, H, I]). Each expert's dW
    within the error bound of a sum over its rows of rounded operands (correctness.check with the terms'
    magnitudes; an expert with no rows: exact zeros), the gating weights' gradient likewise for the
    reduction over H and I (``scale``: the harness check's); (ok, the largest relative error, the
    reason)."""
    dw_t, dgu, ddn = got
    ref_t = torch.zeros(wts.shape, dtype=torch.float64, device=wts.device)
    mag_t = torch.zeros_like(ref_t)
    worst = 0.0
    for e in range(w_gu.shape[0]):
        t = _expert_terms(e, x, ids, wts, w_gu, w_dn, dy)
        if t is None:
            if (dgu[e] != 0).any() or (ddn[e] != 0).any():
                return False, math.inf, f"expert {e} has no rows but a nonzero weight gradient"
            continue
        ref_t[t["tok"], t["j"]] = (t["dye"] * (t["act"] @ t["dn_w"].T)).sum(1)
        mag_t[t["tok"], t["j"]] = (t["dye"].abs() * (t["mag"]["act"] @ t["dn_w"].abs().T)).sum(1)
        rows = int(t["tok"].numel())
        sdy = t["s"] * t["dye"]
        for name, out, ref, mag in (
            (f"dW_dn[{e}]", ddn[e], sdy.T @ t["act"], sdy.abs().T @ t["mag"]["act"]),
            (f"dW_gu[{e}]", dgu[e], t["dgu"].T @ t["xe"], t["mag"]["dgu"].T @ t["xe"].abs()),
        ):
            # each element a sum over the expert's rows of products of rounded intermediates, themselves
            # sums over H or I: held to the error bound of such sums (correctness.check's magnitude), which
            # no cancellation escapes
            ok, rel, why = check(out, ref, rows, scale=scale, magnitude=mag)
            worst = max(worst, rel)
            if not ok:
                return False, rel, f"{name}: {why}"
    # the gating weights' gradient comes back in their dtype (fp32) from products in the layer's (x's): held
    # to the tolerance of x's dtype
    ok, rel, why = check(
        dw_t.to(x.dtype), ref_t, w_dn.shape[1] + w_gu.shape[1] // 2, scale=scale, magnitude=mag_t
    )
    return ok, max(worst, rel), ("d topk_weights: " + why if why else "")


class Step:
    """One contender's step over shared leaves: the forward ``fwd(x, wts, w_gu, w_dn)`` and, for
    "fwd+bwd", the backward of ``dy``; returns dX (or, for "fwd", the output). Every gradient is cleared
    before the step and the weights' and gating weights' after it, so that no contender holds another's
    gradients (their memory is part of the step, each step allocating its own). ``weights``: the two tensors
    whose gradients are dW_gu and dW_dn, which :meth:`other_grads` returns from one more step for the
    check (nothing is kept past it)."""

    def __init__(self, fwd, leaves, params, dy, phase: str, weights=()):
        self.fwd, self.leaves, self.params, self.dy, self.phase = fwd, leaves, params, dy, phase
        self.weights = tuple(weights)
        self._keep = None

    def __call__(self):
        x = self.leaves[0]
        for p in (*self.leaves, *self.params):
            p.grad = None
        y = self.fwd()
        if self.phase == "fwd":
            return y
        y.backward(self.dy)
        if self._keep is not None:
            self._keep.append((self.leaves[1].grad, *(w.grad for w in self.weights)))
        for p in (*self.leaves[1:], *self.params):
            p.grad = None
        return x.grad

    def other_grads(self):
        """(d wts, dW_gu, dW_dn) of one step (fwd+bwd), or None where the step has no ``weights``."""
        if len(self.weights) != 2:
            return None
        self._keep = []
        try:
            self()
            return self._keep[0]
        finally:
            self._keep = None


def memo_bind(make):
    """A contender's bind that makes its call once per input set (measure and the peak-memory step share
    it; a compiled contender compiles once); ``bind.made``: the calls made, by input set."""
    made = {}

    def bind(inp):
        key = tuple(id(t) for t in inp)
        if key not in made:
            made[key] = make(inp)
        return made[key]

    bind.made = made
    return bind


def full_check(bind, ref_dx, k, x, ids, wts, dy, scale: float = 1.0):
    """The fwd+bwd check: dX against float64 (the step's output), then every other gradient of one more step
    (check_weight_grads), so that a contender that gets dX right and a weight gradient wrong is recorded as
    wrong, not timed."""

    def own(out):
        ok, rel, why = check(out, ref_dx, k, scale=scale)
        if not ok:
            return ok, rel, "dX: " + why
        got = next(iter(bind.made.values())).other_grads()
        if got is None or any(t is None for t in got):
            return False, math.nan, "the step kept no gradient of the gating weights or of a weight"
        w_gu, w_dn = (w.detach() for w in next(iter(bind.made.values())).weights)
        ok2, rel2, why2 = check_weight_grads(got, x.detach(), ids, wts.detach(), w_gu, w_dn, dy, scale)
        return ok2, max(rel, rel2), why2

    return own


def contenders(
    x, ids, wts, dy, e: int, phase: str, ref_y, k: int, compiled: bool, uk, tuned_by: str = "", ref_dx=None
) -> list[Contender]:
    """The contenders of one cell and phase (see the module's docstring). ``x`` and ``wts`` are the leaves
    (requires_grad); an input set is (w_gate_up, w_down), leaves too. "fwd": the output checked against
    ``ref_y``; "fwd+bwd": dX against ``ref_dx`` and every other gradient against float64 (full_check)."""

    fields = {"phase": phase}

    def own_of(bind):
        if phase == "fwd":
            return lambda out: check(out, ref_y, k)
        return full_check(bind, ref_dx, k, x, ids, wts, dy)

    def plain(name, fn, graph=True, extra=None, config=None):
        def make(inp):
            leaves = (x, wts, inp[0], inp[1])
            return Step(lambda: fn(x, ids, wts, inp[0], inp[1]), leaves, (), dy, phase, weights=inp)

        bind = memo_bind(make)
        return Contender(
            name, bind, graph=graph, check=own_of(bind), fields={**fields, **(extra or {})}, config=config
        )

    def ours_recompute(x, ids, wts, a, b):
        return moe_ffn(x, ids, wts, a, b, w_layout="nk", validate=False, save_gate_up=False)

    def hf(name, impl, comp, graph=True):
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
        except ImportError as ex:
            return failed_contender(name, f"transformers 5.x (ExpertsInterface) not importable: {ex}")

        def make(inp):
            mod = hf_experts(inp[0], inp[1], impl)
            for p in mod.parameters():
                p.requires_grad_(True)
            fn = torch.compile(mod, fullgraph=True, dynamic=False) if comp else mod  # per T: its best code
            weights = (mod.gate_up_proj, mod.down_proj)  # [E, 2I, H], [E, H, I]
            return Step(lambda: fn(x, ids, wts), (x, wts), tuple(mod.parameters()), dy, phase, weights)

        bind = memo_bind(make)
        return Contender(
            name,
            bind,
            graph=graph,
            check=own_of(bind),
            fields={**fields, "config_source": impl + (", compiled" if comp else "")},
        )

    def ours(x, ids, wts, a, b):
        return moe_ffn(x, ids, wts, a, b, w_layout="nk", validate=False)

    def pipeline(x, ids, wts, a, b):
        return torch_pipeline_train(x, ids, wts, a, b, e)

    cs = [
        plain("ours:moe_ffn", ours),
        plain("ours:moe_ffn:recompute", ours_recompute),
        plain("torch._grouped_mm pipeline", pipeline),
    ]
    if compiled:
        cs += [
            plain("torch._grouped_mm pipeline:compiled", torch.compile(pipeline, dynamic=False)),
            hf("hf:grouped_mm:compiled", "grouped_mm", True),
        ]
    if uk is not None:
        tuned: dict = {}  # the configs Unsloth's tuner chose, filled by the first call

        def unsloth(x, ids, wts, a, b):
            return unsloth_moe.moe_layer(uk, x, ids, wts, a, b, record=tuned)

        cs.append(
            plain(
                "unsloth:grouped_gemm",
                unsloth,
                extra={
                    "config_source": uk.origin + (f"; configs from {tuned_by}" if tuned_by else ""),
                    "peer_revision": uk.revision,
                },
                config=tuned,
            )
        )
    cs.append(hf("per-expert-loop", "eager", False, graph=False))
    return cs


def unsloth_tuned(uk, results_dir: Path, slug: str) -> str:
    """Put in place the configs of Unsloth's tuner run (tune_unsloth.csv in ``results_dir``, or in
    results/<slug>/ for a shard's output) for Unsloth's first calls; returns where they came from, or "" where
    no such file holds a layer shape (the first call then tunes)."""
    import pandas as pd

    for d in (results_dir, ROOT / "results" / slug):
        path = d / "tune_unsloth.csv"
        if path.exists():
            rows = pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
            n = unsloth_moe.seed_configs(uk, rows)
            return f"Unsloth's tuner in tune_unsloth ({path.name}, {n} layer shapes)" if n else ""
    return ""


def step_columns(rows: list[dict]) -> None:
    """A fwd+bwd row's FLOPs and floor: three times the forward's (dX and dW each one more pass of the
    forward's GEMMs), and the rates from them."""
    for r in rows:
        r["flops"] *= 3
        r["floor_us"] *= 3
        r.update(graph_rates(r.get("graph_us", math.nan), r["flops"], r["floor_us"]))


def step_memory(call) -> tuple[int, int]:
    """(torch.cuda.max_memory_allocated over one call, that less what was allocated before it)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak, peak - base


def fits(m: dict, t: int, total_bytes: int) -> bool:
    """Whether a cell's step fits: the weights and their gradients, and the largest contender's activations
    and transients (the torch pipeline's: rows x (2H + 6I) elements kept or in flight, bf16, and fp32 copies
    of the down output), with the float64 reference's dX and y, within 80% of the GPU's memory."""
    h, i = layer_sizes(m)
    rows = t * m["top_k"]
    weights = m["experts"] * 3 * h * i * 2
    acts = rows * (2 * h + 6 * i) * 2 + rows * h * 4 + 2 * t * h * 8
    return 2 * weights + 2 * acts < 0.8 * total_bytes


def run_selection(e9: dict) -> dict:
    """The pipeline's E9 run: config.yaml's ``moe_train.run`` over ``moe_train`` (each key it lacks: the
    zoo's; ``models`` and ``unsloth_models`` default every zoo model)."""
    keys = ("tokens", "loads", "compiled_tokens")
    return {"models": None, "unsloth_models": None, **{k: e9[k] for k in keys}, **e9.get("run", {})}


def unsloth_joins(run: dict, model: str) -> bool:
    """Whether Unsloth's kernels join ``model``'s cells in the run ``run`` (``run_selection``)."""
    return selected(run["unsloth_models"], model)


def train_cells(g: dict, e9: dict, total_bytes: int) -> list[tuple[str, int, str]]:
    """E9's run's cells (model, T, load): its models (in the zoo's order), T and loads, where the step fits
    in ``total_bytes`` of GPU memory (``fits``)."""
    run = run_selection(e9)
    check_models(run["models"], g["models"], "moe_train.run.models")
    check_models(
        run["unsloth_models"], run["models"] or g["models"], "moe_train.run.unsloth_models", "E9's models"
    )
    return [
        (model, t, load)
        for model in g["models"]
        if selected(run["models"], model)
        for t in run["tokens"]
        for load in run["loads"]
        if fits(g["models"][model], t, total_bytes)
    ]


def cell_inputs(g: dict, model: str, t: int, load: str, weights: dict, device="cuda"):
    """(zoo entry, E, top_k, H, I, ids, x, gating weights, dY) of one cell from fixed seeds (E8's weights;
    ``weights`` holds one model's at a time); x and the gating weights require grad."""
    m = g["models"][model]
    e, top_k = m["experts"], m["top_k"]
    h, i = layer_sizes(m)
    if model not in weights:
        weights.clear()
        torch._dynamo.reset()
        weights[model] = tuple(w.requires_grad_() for w in ffn_weights(g["seed"] + 8, e, h, i, device=device))
    seed = g["seed"] + 9 * 1009 + t * 7 + sum(map(ord, load))
    ids = sample_topk(t, e, top_k, load, seed).to(torch.int64).to(device)
    gx = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(t, h, device=device, generator=gx).to(torch.bfloat16).requires_grad_()
    wts = torch.softmax(torch.randn(t, top_k, device=device, generator=gx), -1).requires_grad_()
    dy = (torch.randn(t, h, device=device, generator=gx) / math.sqrt(h)).to(torch.bfloat16)
    return m, e, top_k, h, i, ids, x, wts, dy


def main():
    args, cfg, g, settings, prov, slug, writer = start(__doc__, ("model", "tokens", "load", "phase"))
    # one contender's graph at a time: a training step's graph holds its gradients and activations
    settings = dataclasses.replace(settings, one_graph=True)
    e9 = cfg["moe_train"]
    total = torch.cuda.get_device_properties(0).total_memory
    cells = train_cells(g, e9, total)
    run = run_selection(e9)
    cells = shard_cells(cells, args.shard)
    raise_recompile_limit(256)  # the compiled contenders: a graph per (T, load, phase) of each model
    uk, why = unsloth_moe.load()
    print(f"Unsloth's MoE kernels: {uk.origin if uk else why}", flush=True)
    tuned_by = ""
    if uk is not None:
        tuned_by = unsloth_tuned(uk, Path(args.out).resolve().parent, slug)
        where = tuned_by or "its tuner, on the first call of each layer shape"
        print(f"Unsloth's configs: {where}", flush=True)
    bar = Progress(len(cells), "E9")
    weights: dict = {}
    for model, t, load in cells:
        t_cell = time.perf_counter()
        m, e, top_k, h, i, ids, x, wts, dy = cell_inputs(g, model, t, load, weights)
        w_gu, w_dn = weights[model]
        active = int(torch.unique(ids).numel())
        with torch.no_grad():
            ref_y, ref_dx = ref_step(x, ids, wts, w_gu, w_dn, dy)
        for phase in e9["phases"]:
            if writer.done(model=model, tokens=t, load=load, phase=phase):
                continue
            peer = uk if unsloth_joins(run, model) else None
            cs = contenders(
                x, ids, wts, dy, e, phase, ref_y, h + i, t in run["compiled_tokens"], peer, tuned_by, ref_dx
            )
            sets = [(w_gu, w_dn)]
            out = measure(cs, sets, ref_dx, h + i, settings)
            for c, row in zip(cs, out):
                if row.get("status") == "ok":
                    try:
                        row["peak_mem_bytes"], row["step_mem_bytes"] = step_memory(c.bind(sets[0]))
                    except Exception as ex:  # noqa: BLE001 - recorded, not fatal
                        row["note"] = (row.get("note") or "") + f" peak memory: {type(ex).__name__}"
            annotate(out, "E9", m, model, t, load, h, i, active, len(sets), slug, prov)
            if phase == "fwd+bwd":
                step_columns(out)
            writer.add(out)
            del cs
        del ref_y, ref_dx
        print(f"E9 {model} T={t} {load}: {time.perf_counter() - t_cell:.1f} s", file=sys.stderr, flush=True)
        bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
