"""E6 router-gemm: the DeepSeek-V3 router `[T,7168] @ [7168,256]`, decode T = 1..256 and prefill up to
T = 16384, epilogues none and sigmoid (logits -> scores), bf16; and ReLU at decode (``relu_max_tokens``), the
one epilogue the seed's kernels fuse, so that ours and the seed's optimized kernel are compared like for like
(both fused); with the sigmoid the seed's kernels run it as a separate launch (what their user pays). The
``split`` column says whether the Decompose-K tuner saw that T (tune) or not (heldout: `auto` runs on its
heuristic there).

Contenders: eager, torch.compile(max-autotune-no-cudagraphs) per exact T, the custom-op autotuned path with
range dispatch on T (one dynamic-T compile; Inductor benchmarks mm vs decomposeK per T range and emits a
runtime dispatch) at ``compiled_tokens`` and ``compiled_epilogues``, the seed's two Triton kernels at decode
(its own config search, tune_seed; the sigmoid after them), our kernels (tuned config) and our `auto`
(which may dispatch to cuBLAS; ``config_source`` says what it chose).

    python -m experiments.e6_router_gemm --out results/<slug>/router_gemm.csv
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments import dk
from experiments.common import (
    Progress,
    ResultWriter,
    cli,
    load_config,
    provenance_fields,
    raise_recompile_limit,
    require_gpu,
    timing_settings,
)
from experiments.harness.runner import Contender
from moegemm.epilogue import Epilogue
from moegemm.inductor import custom_op

DISPATCH_SPLITS = [16, 64, 256]  # T ranges [1,16], [17,64], [65,256], [257, inf)


def range_dispatch(epilogue: str) -> Contender:
    """One compiled function for every T (T marked dynamic); Inductor picks per range."""
    epi = Epilogue.parse(epilogue)
    cf = torch.compile(lambda x, w: epi.torch_apply(custom_op.mm(x, w)), mode="max-autotune-no-cudagraphs")

    def bind(inp):
        a, b, _ = inp
        torch._dynamo.maybe_mark_dynamic(a, 0)  # T=1 stays a static specialisation
        return lambda: cf(a, b)

    return Contender("custom-op-range-dispatch", bind, config={"split_points": DISPATCH_SPLITS})


def main():
    args = cli(__doc__)
    require_gpu()
    cfg = load_config(args.config)
    r = cfg["decompose_k"]["router"]
    custom_op.register(dispatch_splits=DISPATCH_SPLITS)
    # The per-T compiles share one code object; without this Dynamo would silently stop compiling after 8 T.
    raise_recompile_limit(256)
    settings = timing_settings(cfg)
    prov = provenance_fields()
    tiny = dk.tiny_kernel_us()
    writer = ResultWriter(args.out, ("epilogue", "m"))
    tokens = r["tokens"]
    tuned = set(r.get("tune_tokens", r["tokens"]))
    compiled_t = set(r.get("compiled_tokens", r["tokens"]))
    compiled_epi = set(r.get("compiled_epilogues", [e for e in r["epilogues"] if e != "relu"]))
    results_dir = str(Path(args.out).parent)
    relu_max = r.get("relu_max_tokens", max(tokens))
    per_epi = {epi: [t for t in tokens if epi != "relu" or t <= relu_max] for epi in r["epilogues"]}
    bar = Progress(sum(map(len, per_epi.values())), "E6")
    for epilogue in r["epilogues"]:
        dispatch = range_dispatch(epilogue)  # shared across T: its compile happens once per range
        for t in per_epi[epilogue]:
            if not writer.done(epilogue=epilogue, m=t):
                probe = torch.empty(t, r["k"], dtype=torch.bfloat16, device="cuda")
                cs = [dk.eager(epilogue)]
                # the compiled contenders (tens of seconds each) at ``compiled_epilogues`` (by default all but
                # ReLU, whose cells are the like-for-like comparison with the seed's kernels)
                if t in compiled_t and epilogue in compiled_epi:
                    cs += [
                        dk.compiled(
                            dk.epilogue_fn(epilogue),
                            "max-autotune-no-cudagraphs",
                            "compiled",
                            inspect_mn=(t, r["n"]),
                        ),
                        dispatch,
                    ]
                if t <= r["seed_max_tokens"]:
                    cs += dk.seed_kernels(results_dir, t, r["n"], r["k"], torch.bfloat16, epilogue)
                for kernel in dk.KERNELS:
                    c, src = dk.tuned_or_heuristic(probe, r["n"], epilogue, kernel)
                    cs.append(dk.ours(kernel, epilogue, c, config_source=src))
                cs.append(
                    dk.ours(
                        "auto",
                        epilogue,
                        None,
                        name="ours:auto",
                        config_source=dk.auto_choice(probe, r["n"], epilogue),
                    )
                )
                writer.add(
                    dk.run_shape(
                        "E6",
                        cs,
                        t,
                        r["n"],
                        r["k"],
                        torch.bfloat16,
                        epilogue,
                        settings,
                        prov,
                        tiny,
                        seed=t,
                        split="tune" if t in tuned else "heldout",
                    )
                )
            bar.update()
    bar.close()
    writer.finish()


if __name__ == "__main__":
    main()
