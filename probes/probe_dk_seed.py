"""Probe (not a pipeline step): our single-launch kernel against the seed's optimized Triton kernel, cuBLAS
and eager on a few bf16 ReLU shapes, each side searched its own way, then measured side by side.

- ours: every single_launch candidate of the Decompose-K tuner (experiments/dk.py) timed on the GPU clock,
  the fastest kept;
- the seed's optimized kernel: its own coordinate-descent search (experiments/seed_dk.py);
- then both winners, eager relu(mm) and our `auto` measured together (both clocks, cpu_us).

    MOEGEMM_SEED_SOURCE=... python -m probes.probe_dk_seed --out probe.csv [--shapes 16x8192x16,...]
"""

from __future__ import annotations

import time

import torch

from experiments import dk, seed_dk
from experiments.common import ResultWriter
from probes.common import probe_cli, screen_single_launch

DEFAULT = (
    "16x8192x16,16x32768x16,32x16384x32,48x24576x48,64x8192x64,64x32768x64,1x7168x256,16x7168x256,"
    "64x7168x256,256x7168x256"
)


def main():
    args, settings, prov, sms = probe_cli(__doc__, DEFAULT)
    seed = seed_dk.load()
    writer = ResultWriter(args.out, ("m", "n", "k", "contender"))
    table = []
    for m, k, n in args.shapes:
        shape = f"{m}x{k}x{n}"
        sets, ref = dk.shape_inputs(m, n, k, torch.bfloat16, seed=m + k + n, epilogue="relu")
        t0 = time.perf_counter()
        ours_best = screen_single_launch(
            sets, ref, dk.candidates(m, n, k, torch.bfloat16, "single_launch", sms), settings
        )[0][1]
        a0 = sets[0][0]
        t_ours = time.perf_counter() - t0
        cs = [
            dk.eager("relu"),
            dk.ours("single_launch", "relu", ours_best, name="ours:single_launch"),
            dk.ours("auto", "relu", None, name="ours:auto", config_source=dk.auto_choice(a0, n, "relu")),
        ]
        t_seed = 0.0
        if seed is not None:
            for variant in seed_dk.VARIANTS:
                t0 = time.perf_counter()
                best, _, n_timed = seed_dk.search(
                    seed.modules[variant], variant, sets, ref, k, "relu", settings
                )
                t_seed += time.perf_counter() - t0
                if best is not None:
                    cs.append(
                        seed_dk.contender(seed.modules[variant], variant, best, "relu", configs_timed=n_timed)
                    )
        rows = dk.run_shape(
            "probe", cs, m, n, k, torch.bfloat16, "relu", settings, prov, dk.tiny_kernel_us(), seed=m * 3 + k
        )
        for r in rows:
            r.update(search_s_ours=round(t_ours, 1), search_s_seed=round(t_seed, 1))
        writer.add(rows)
        by = {r["contender"]: r for r in rows}
        table.append((shape, by))
    writer.finish()
    names = ["ours:single_launch", "ours:auto", "seed: optimized", "seed: original", "eager"]
    print("shape | " + " | ".join(names) + " | floor   (graph_us; cpu_us in brackets)")
    for shape, by in table:
        cells = []
        for nm in names:
            r = by.get(nm)
            cells.append(
                "-"
                if r is None or r.get("status") != "ok"
                else f"{float(r['graph_us']):.2f} [{float(r.get('cpu_us', float('nan'))):.0f}]"
            )
        floor = next(iter(by.values()))["floor_us"]
        print(f"{shape} | " + " | ".join(cells) + f" | {float(floor):.2f}")


if __name__ == "__main__":
    main()
