"""Probe (not a pipeline step): what the single-launch kernel's time depends on, on a few bf16 ReLU shapes.

1. A wide config space (``dk.wide_candidates``: 16-wide tiles, 1-4 warps, BLOCK_K 64-256) timed on the GPU
   clock through the plan (the cooperative form), the fastest kept.
2. At that config, side by side: the cooperative form as launched (cooperative attribute), the same
   kernel launched without the attribute (its grid fits, so it runs; nothing guarantees that in general),
   and the last-arriver form.

    python -m probes.probe_dk_design --out probe_design.csv [--shapes 16x8192x16,...]
"""

from __future__ import annotations

import torch

from experiments import dk
from experiments.common import ResultWriter
from experiments.harness.runner import Contender
from moegemm.decompose_k import single_launch
from moegemm.decompose_k.configs import Prepared
from moegemm.epilogue import Epilogue
from probes.common import probe_cli, screen_single_launch

DEFAULT = "16x8192x16,64x8192x64,64x32768x64,1x7168x256"


def direct(cfg, coop: bool, attr: bool, name: str) -> Contender:
    """Our kernel launched through Triton with COOP and the cooperative attribute as given."""

    def bind(inp):
        a, b, _ = inp
        m, n = a.shape[0], b.shape[1]
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
        p = Prepared(a=a, b=b, out=out, bias=None, epilogue=Epilogue.RELU, allow_tf32=False)
        ws, cnt = (
            single_launch.coop_state(m, n, cfg, a.device)
            if coop
            else (single_launch.alloc_workspace(m, n, cfg, a.device), single_launch.counters(a.device, 4096))
        )
        args = single_launch.kernel_args(p, cfg, ws, cnt, coop)
        g = single_launch.grid(m, n, cfg)
        extra = {"launch_cooperative_grid": True} if attr else {}

        def call():
            single_launch._single_launch_kernel[g](
                **args, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra
            )
            return out

        return call

    return Contender(name, bind, config=cfg.as_dict())


def main():
    args, settings, prov, sms = probe_cli(__doc__, DEFAULT)
    writer = ResultWriter(args.out, ("m", "n", "k", "contender"))
    lines = []
    for m, k, n in args.shapes:
        shape = f"{m}x{k}x{n}"
        sets, ref = dk.shape_inputs(m, n, k, torch.bfloat16, seed=m + 3 * k + n, epilogue="relu")
        cands = [c for c in dk.wide_candidates(m, n, k, torch.bfloat16, sms) if c.num_stages == 3]
        timed = screen_single_launch(sets, ref, cands, settings)
        writer.add(
            [
                {"m": m, "n": n, "k": k, "contender": f"screen:{i}", "config": c.as_dict(), **r, **prov}
                for i, (_, c, r) in enumerate(timed, 1)
            ]
        )
        best = timed[0][1]
        by_warps = {}
        for us, c, _ in timed:
            by_warps.setdefault(c.num_warps, (us, c))
        cs = [
            direct(best, True, True, "coop"),
            direct(best, True, False, "coop-no-attribute"),
            direct(best, False, False, "last-arriver"),
        ]
        for w, (us, c) in sorted(by_warps.items()):
            cs.append(dk.ours("single_launch", "relu", c, name=f"best-{w}-warps"))
        rows = dk.run_shape(
            "probe", cs, m, n, k, torch.bfloat16, "relu", settings, prov, dk.tiny_kernel_us(), seed=m * 5 + k
        )
        writer.add(rows)
        lines.append(
            f"{shape}: best {best.as_dict()} | "
            + " | ".join(f"{r['contender']} {float(r.get('graph_us', 'nan')):.2f}" for r in rows)
            + f" | floor {rows[0]['floor_us']:.2f}"
        )
    writer.finish()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
