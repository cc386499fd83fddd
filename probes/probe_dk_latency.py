"""Probe (not a pipeline step): where the single-launch kernel's time goes on the skinny bf16 ReLU shapes,
and how far below the seed's optimized kernel any kernel of this grid could go.

At the config ``auto`` runs for each shape, side by side in one process (GPU clock):

- ``ours:auto`` (the plan), and the same kernel launched directly through Triton with and without the
  cooperative attribute (``direct:coop``, ``direct:no-attribute``);
- lower bounds of any kernel with this grid: ``ceiling:empty`` (the grid launched, no work) and
  ``ceiling:load`` (each program's K loop, its partial stored straight into C, no exchange: a wrong
  answer, timed only), each with and without the cooperative attribute;
- with ``--screen``: ``ceiling:load:fastest-config``, the exchange-free kernel (no attribute) at the
  fastest config of the Decompose-K tuner's whole single-launch space for the shape;
- the seed's two Triton kernels at their own search's configs (``tune_seed.csv``).

Two other waits in the kernel (per-thread re-reads; relaxed GPU-scope loads) and M as a compile-time
constant are not offered: timed (their rows are among the superseded runs in results/<gpu>/runs.tar.xz),
none was faster.

    MOEGEMM_SEED_SOURCE=... python -m probes.probe_dk_latency --out probe_dk_latency.csv [--screen]
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from experiments import dk
from experiments.common import ResultWriter
from experiments.harness.runner import Contender
from moegemm.decompose_k import single_launch
from moegemm.decompose_k._partial import partial_tile
from moegemm.decompose_k.configs import Prepared, choose
from moegemm.epilogue import Epilogue
from probes.common import probe_cli

DEFAULT = "16x8192x16,16x32768x16,32x16384x32,48x24576x48,64x8192x64,64x32768x64,1x7168x256,64x7168x256"


@triton.jit
def _ceiling_kernel(
    a_ptr, b_ptr, c_ptr, M,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    N: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """LOAD: each program's K slice of A and B into its fp32 tile (the library's partial_tile), stored into C
    as it is (every split writes the same tile: timing only); else nothing at all."""
    if LOAD:
        num_pid_n = tl.cdiv(N, BLOCK_N)
        KPS: tl.constexpr = (K + S - 1) // S
        acc, offs_m, offs_n = partial_tile(
            a_ptr,
            b_ptr,
            M,
            N,
            K,
            KPS,
            tl.program_id(1),
            stride_am,
            stride_ak,
            stride_bk,
            stride_bn,
            tl.program_id(0) // num_pid_n,  # the tile's row and column (no swizzle)
            tl.program_id(0) % num_pid_n,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            False,
            PRECISION,
            UPCAST,
        )
        ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(
            c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=ok,
        )


def _timing_only(out):
    return True, math.nan, "timing only: not a product (a lower bound)"


def direct(cfg, coop_attr: bool) -> Contender:
    """Our kernel, cooperative form, launched through Triton; one workspace and counter set for every input
    set (as a plan keeps per stream). ``coop_attr=False``: the same kernel without the cooperative attribute
    (it runs, as its grid fits; nothing guarantees that)."""
    state = {}

    def bind(inp):
        a, b, _ = inp
        m, n = a.shape[0], b.shape[1]
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
        p = Prepared(a=a, b=b, out=out, bias=None, epilogue=Epilogue.RELU, allow_tf32=False)
        if not state:
            state["ws"], state["cnt"] = single_launch.coop_state(m, n, cfg, a.device)
        args = single_launch.kernel_args(p, cfg, state["ws"], state["cnt"], True)
        g = single_launch.grid(m, n, cfg)

        def call():
            single_launch._single_launch_kernel[g](
                **args, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_cooperative_grid=coop_attr
            )
            return out

        return call

    return Contender("direct:coop" if coop_attr else "direct:no-attribute", bind, config=cfg.as_dict())


def ceiling(cfg, load: bool, coop_attr: bool = True, label: str | None = None) -> Contender:
    def bind(inp):
        a, b, _ = inp
        m, n = a.shape[0], b.shape[1]
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
        g = single_launch.grid(m, n, cfg)

        def call():
            _ceiling_kernel[g](
                a,
                b,
                out,
                m,
                a.stride(0),
                a.stride(1),
                b.stride(0),
                b.stride(1),
                out.stride(0),
                out.stride(1),
                N=n,
                K=a.shape[1],
                S=cfg.split_k,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                LOAD=load,
                PRECISION="tf32",
                UPCAST=False,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                launch_cooperative_grid=coop_attr,
            )
            return out

        return call

    name = label or (("ceiling:load" if load else "ceiling:empty") + ("" if coop_attr else ":no-attribute"))
    return Contender(name, bind, config=cfg.as_dict(), check=_timing_only)


def fastest_ceiling(sets, cands, settings):
    """The exchange-free kernel (``ceiling:load``, no cooperative attribute) over a config space: each
    timed on the GPU clock, the fastest config."""
    import statistics

    from experiments.harness.runner import graph_timer, prewarm

    binds = [ceiling(c, True, False).bind for c in cands]
    prewarm([bd(sets[0]) for bd in binds])
    best = None
    for c, bd in zip(cands, binds):
        calls = [bd(s) for s in sets]
        calls[0]()
        us = statistics.median(graph_timer(calls, settings).sample(3))
        if best is None or us < best[0]:
            best = (us, c)
    return best[1], len(cands)


def main():
    args, settings, prov, sms = probe_cli(__doc__, DEFAULT, flags=("--screen",))
    results_dir = (
        str(Path(args.out).parent)
        if Path(args.out).parent.joinpath("tune_seed.csv").exists()
        else "results/nvidia-h200"
    )
    writer = ResultWriter(args.out, ("m", "n", "k", "contender"))
    table = []
    for m, k, n in args.shapes:
        a0 = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        _, cfg, source = choose(a0, n, Epilogue.RELU, "single_launch")
        cs = [dk.ours("auto", "relu", None, name="ours:auto", config_source=dk.auto_choice(a0, n, "relu"))]
        cs += [direct(cfg, True), direct(cfg, False)]
        cs += [ceiling(cfg, False), ceiling(cfg, True), ceiling(cfg, False, False), ceiling(cfg, True, False)]
        if args.screen:
            sets, _ = dk.shape_inputs(m, n, k, torch.bfloat16, seed=m + k + n)
            best, n_cands = fastest_ceiling(
                sets, dk.candidates(m, n, k, torch.bfloat16, "single_launch", sms), settings
            )
            c = ceiling(best, True, False, label="ceiling:load:fastest-config")
            c.fields = {"configs_timed": n_cands}
            cs.append(c)
        cs += dk.seed_kernels(results_dir, m, n, k, torch.bfloat16, "relu")
        rows = dk.run_shape(
            "probe",
            cs,
            m,
            n,
            k,
            torch.bfloat16,
            "relu",
            settings,
            prov,
            dk.tiny_kernel_us(),
            seed=m * 7 + k,
            single_launch_source=source,
        )
        writer.add(rows)
        table.append((f"{m}x{k}x{n}", {r["contender"]: r for r in rows}))
    writer.finish()
    names = [c for c in table[0][1]]
    print("shape | " + " | ".join(names) + "   (graph_us)")
    for shape, by in table:
        print(
            f"{shape} | "
            + " | ".join(
                "-" if by.get(nm, {}).get("status") != "ok" else f"{float(by[nm]['graph_us']):.2f}"
                for nm in names
            )
        )


if __name__ == "__main__":
    main()
