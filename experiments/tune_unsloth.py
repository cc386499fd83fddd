"""Unsloth's own config search for its MoE kernels (experiments/unsloth_moe.py), once per layer shape that E9
runs Unsloth on, so that E9 times Unsloth's kernels at the configs its tuner picks, as a machine's later
runs of Unsloth get them: Unsloth tunes the forward, dX and dW kernels of a layer's two GEMMs on its first
call and keeps the choice in its disk cache (~/.cache/unsloth/moe_autotune), which every later process
reads. The search is Unsloth's (``get_or_autotune_moe_kernels``, forced to tune, with the dimensions
unsloth_zoo passes it); this records what it chose and how long it took, per GEMM: one row per (model,
GEMM), its three configs as JSON (the fields Unsloth's cache stores), ``tune_s`` and what the tuner warned
of (a failed tuning falls back to Unsloth's default configs with only a log line).

Without ``MOEGEMM_UNSLOTH_SOURCE`` the CSV holds one row that says so, and E9 runs without Unsloth.

    python -m experiments.tune_unsloth --out results/<slug>/tune_unsloth.csv
"""

from __future__ import annotations

import json
import time

import torch

from experiments import unsloth_moe
from experiments.common import (
    DTYPES,
    Progress,
    ResultWriter,
    cli,
    load_config,
    provenance_fields,
    require_gpu,
)
from experiments.e8_moe_layer import layer_sizes
from experiments.e9_moe_train import run_selection, train_cells, unsloth_joins

DTYPE = "bfloat16"  # E9's weights and activations


def layer_shapes(cfg: dict, total_bytes: int) -> list[str]:
    """The zoo models whose cells E9's run gives Unsloth's kernels (in the zoo's order)."""
    g, e9 = cfg["grouped"], cfg["moe_train"]
    run = run_selection(e9)
    models = dict.fromkeys(m for m, _, _ in train_cells(g, e9, total_bytes))
    return [m for m in models if unsloth_joins(run, m)]


def shape_row(model: str, gemm: str, m: dict) -> dict:
    """One GEMM's key fields: the layer shape E9 looks it up by (unsloth_moe.seed_configs: experts, hidden,
    intermediate, top_k, dtype, gemm) and the dimensions Unsloth's tuner is given (tuner_hidden,
    tuner_intermediate)."""
    h, i = layer_sizes(m)
    hidden, inter = unsloth_moe.gemm_dims(h, i)[gemm]
    return {
        "model": model,
        "gemm": gemm,
        "experts": m["experts"],
        "hidden": h,
        "intermediate": i,
        "top_k": m["top_k"],
        "dtype": DTYPE,
        "tuner_hidden": hidden,
        "tuner_intermediate": inter,
    }


def tuned_row(model: str, gemm: str, m: dict, configs: tuple | None, note: str) -> dict:
    """One GEMM's row: its key fields (shape_row), and its (forward, dX, dW) configs as JSON with what the
    tuner warned of (``note``); ``configs`` None: the search failed, ``note`` says why."""
    row = shape_row(model, gemm, m)
    if configs is None:
        return {**row, "status": "error", "note": note}
    plain = [json.dumps(unsloth_moe.plain_config(c), sort_keys=True) for c in configs]
    return {**row, "status": "ok", **dict(zip(("fwd", "dX", "dW"), plain)), "tuner_warnings": note}


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    prov = provenance_fields()
    writer = ResultWriter(args.out, ("model", "gemm"))
    uk, why = unsloth_moe.load()
    if uk is None:
        writer.add([{"model": "none", "gemm": "none", "status": "unavailable", "note": why, **prov}])
        writer.finish()
        return
    g = cfg["grouped"]
    models = layer_shapes(cfg, torch.cuda.get_device_properties(0).total_memory)
    bar = Progress(2 * len(models), "tune_unsloth")
    for model in models:
        m = g["models"][model]
        for gemm in unsloth_moe.gemm_dims(*layer_sizes(m)):
            if writer.done(model=model, gemm=gemm):
                bar.update()
                continue
            key = shape_row(model, gemm, m)
            t0 = time.perf_counter()
            try:
                configs, warned = unsloth_moe.tune_gemm(
                    uk,
                    key["experts"],
                    key["tuner_hidden"],
                    key["tuner_intermediate"],
                    key["top_k"],
                    DTYPES[DTYPE],
                    force=True,
                )
            except Exception as ex:  # noqa: BLE001 - recorded: E9 then tunes on its first call
                row = tuned_row(model, gemm, m, None, f"{type(ex).__name__}: {str(ex)[:300]}")
            else:
                row = tuned_row(model, gemm, m, configs, warned)
            torch.cuda.empty_cache()
            row.update(
                tune_s=time.perf_counter() - t0,
                config_source=uk.origin,
                peer_revision=uk.revision,
                **prov,
            )
            writer.add([row])
            bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
