# Verify: the kernel tests, under Triton's interpreter without a GPU, natively with one; every GPU step
# waits for them.


rule verify:
    """Run the kernel tests (interpreter on CPU, native on a GPU) and write a machine-readable report."""
    input:
        SRC,
    output:
        f"results/{HERE}/verify.json",
    log:
        f"logs/{HERE}/verify.log",
    benchmark:
        f"results/{HERE}/benchmarks/verify.tsv"
    params:
        py=PY,
    resources:
        gpu=1 if GPUS else 0,
    shell:
        "{params.py} -m experiments.verify --out {output} > {log} 2>&1"

