# Tune (with a GPU): the per-GPU tables the library reads (Decompose-K, grouped GEMM and its default for
# unseen shapes) and the peers' own config searches (the seed's, Unsloth's).


if GPUS:

    rule tune:
        """Per-GPU Decompose-K config table (data read by the library)."""
        input:
            TUNER_VERIFY,
        output:
            csv=f"results/{HERE}/tune_decompose_k.csv",
            table=f"src/moegemm/tuned/decompose_k/{HERE}.json",
        log:
            f"logs/{HERE}/tune.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_decompose_k --out {output.csv} > {log} 2>&1"

    rule tune_grouped:
        """Per-GPU grouped-GEMM tile table (data read by the library)."""
        input:
            TUNER_VERIFY,
        output:
            csv=f"results/{HERE}/tune_grouped.csv",
            table=f"src/moegemm/tuned/grouped/{HERE}.json",
        log:
            f"logs/{HERE}/tune_grouped.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune_grouped.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_grouped --out {output.csv} > {log} 2>&1"

    rule distill_grouped:
        """The grouped GEMM's default for shapes its table lacks: per regime, a shortlist distilled from the
        tune-set models' tuner rows (the first call of an unseen shape times it), and the leave-one-model-out
        slowdown of that construction."""
        input:
            csv=f"results/{HERE}/tune_grouped.csv",
            config="experiments/config.yaml",
            code="experiments/distill_grouped.py",
        output:
            table=f"src/moegemm/tuned/grouped_default/{HERE}.json",
            loo=f"results/{HERE}/distill_grouped.csv",
        log:
            f"logs/{HERE}/distill_grouped.log",
        params:
            py=PY,
        shell:
            "{params.py} -m experiments.distill_grouped --csv {input.csv} --out {output.table} "
            "--loo {output.loo} > {log} 2>&1"

    rule tune_seed:
        """The seed's own config search for its two Triton kernels (E3-E6's "seed: ..." contenders); a CSV
        that says so where MOEGEMM_SEED_SOURCE is not set."""
        input:
            TUNER_VERIFY,
        output:
            f"results/{HERE}/tune_seed.csv",
        log:
            f"logs/{HERE}/tune_seed.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune_seed.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_seed --out {output} > {log} 2>&1"

    rule tune_unsloth:
        """Unsloth's own config search for its MoE kernels, once per layer shape E9 runs them on (E9's
        "unsloth: ..." contender takes its choices, as Unsloth's disk cache serves a machine's later runs); a
        CSV that says so where MOEGEMM_UNSLOTH_SOURCE is not set."""
        input:
            TUNER_VERIFY,
        output:
            f"results/{HERE}/tune_unsloth.csv",
        log:
            f"logs/{HERE}/tune_unsloth.log",
        benchmark:
            f"results/{HERE}/benchmarks/tune_unsloth.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.tune_unsloth --out {output} > {log} 2>&1"
