# Measure (with a GPU): this GPU's floors, then each experiment E1-E10 into results/<gpu>/<experiment>.csv;
# with several GPUs the grouped experiments run as one shard per GPU, merged on the CPU.


if GPUS:

    rule floors:
        """Tiny-kernel time, copy bandwidth and matmul rate of this GPU."""
        input:
            f"results/{HERE}/verify.json",
        output:
            f"results/{HERE}/floors.json",
        log:
            f"logs/{HERE}/floors.log",
        benchmark:
            f"results/{HERE}/benchmarks/floors.tsv"
        params:
            slot=SLOT,
            py=PY,
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.floors --out {output} > {log} 2>&1"


    # What each experiment reads: the Decompose-K experiments (E1-E6) the Decompose-K table (E3-E6 also the
    # seed's search), the grouped ones (E7-E10) the grouped tables. No experiment reads the floors (the
    # write-up does), so with several GPUs E7 and E8 start once the grouped tuner is done, beside the
    # Decompose-K and seed tuners.
    MEASURE_INPUT = dict(
        verify=f"results/{HERE}/verify.json",
        seed=lambda w: [f"results/{HERE}/tune_seed.csv"] if w.experiment in SEED_EXPERIMENTS else [],
        unsloth=lambda w: [f"results/{HERE}/tune_unsloth.csv"] if w.experiment == "moe_train" else [],
        tables=lambda w: [f"src/moegemm/tuned/grouped/{HERE}.json", f"src/moegemm/tuned/grouped_default/{HERE}.json"]
        if w.experiment in GROUPED_EXPERIMENTS else [f"src/moegemm/tuned/decompose_k/{HERE}.json"],
        config="experiments/config.yaml",
    )

    rule measure:
        """One experiment E1..E10 on one GPU (independent jobs: they spread over GPUs)."""
        input:
            **MEASURE_INPUT,
        output:
            f"results/{HERE}/{{experiment}}.csv",
        wildcard_constraints:
            experiment="|".join(e for e in EXPERIMENTS if e not in SHARDED),
        log:
            f"logs/{HERE}/{{experiment}}.log",
        benchmark:
            f"results/{HERE}/benchmarks/{{experiment}}.tsv"
        params:
            slot=SLOT,
            py=PY,
            module=lambda w: EXPERIMENTS[w.experiment],
        resources:
            gpu=1,
        shell:
            "{params.slot} {params.py} -m experiments.{params.module} --out {output} > {log} 2>&1"

    if SHARDED:

        rule measure_shard:
            """With several GPUs, one shard of a long experiment (E7-E10) per GPU: whole models each, about as many
            cells each (experiments.common.shard_cells)."""
            input:
                **MEASURE_INPUT,
            output:
                f"results/{HERE}/shards/{{experiment}}.{{shard}}-of-{SHARDS}.csv",
            wildcard_constraints:
                experiment="|".join(SHARDED),
                shard=r"\d+",
            log:
                f"logs/{HERE}/{{experiment}}.{{shard}}-of-{SHARDS}.log",
            benchmark:
                f"results/{HERE}/benchmarks/{{experiment}}.{{shard}}-of-{SHARDS}.tsv"
            params:
                slot=SLOT,
                py=PY,
                module=lambda w: EXPERIMENTS[w.experiment],
                shards=SHARDS,
            resources:
                gpu=1,
            shell:
                "{params.slot} {params.py} -m experiments.{params.module} --shard {wildcards.shard}/{params.shards} "
                "--out {output} > {log} 2>&1"

        rule merge_shards:
            """A sharded experiment's CSV: its shards' rows, in shard order (on the CPU)."""
            input:
                lambda w: [f"results/{HERE}/shards/{w.experiment}.{i}-of-{SHARDS}.csv" for i in range(SHARDS)],
            output:
                f"results/{HERE}/{{experiment}}.csv",
            wildcard_constraints:
                experiment="|".join(SHARDED),
            log:
                f"logs/{HERE}/{{experiment}}.merge.log",
            params:
                py=PY,
            shell:
                "{params.py} -m experiments.merge_shards --out {output} {input} > {log} 2>&1"
