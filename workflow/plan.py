"""What the pipeline runs on this machine: the experiments (E1..E10) and which of them run as shards, the
results the write-up is built from, the figures it draws and what each reads, and what Snakemake says at
start. workflow/rules/common.smk builds one Plan; kept out of the rules so that it can be tested without
Snakemake or a GPU (tests/test_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.pipeline import machine_slug, results_slug

EXPERIMENTS = {  # output CSV -> experiment module (E1..E10)
    "compile_modes": "e1_compile_modes",
    "inductor_codegen": "e2_inductor_codegen",
    "epilogue_fusion": "e3_epilogue_fusion",
    "split_sweep": "e4_split_sweep",
    "decompose_k_grid": "e5_decompose_k_grid",
    "router_gemm": "e6_router_gemm",
    "grouped_skew": "e7_grouped_skew",
    "moe_layer": "e8_moe_layer",
    "moe_train": "e9_moe_train",
    "fp8_grouped": "e10_fp8",
}
# The experiments with the seed's Triton kernels among their contenders (at the configs of tune_seed)
SEED_EXPERIMENTS = ("epilogue_fusion", "split_sweep", "decompose_k_grid", "router_gemm")
# The grouped experiments: they read the grouped tables (the others the Decompose-K table), and with several
# GPUs they are the long ones that run as one shard per GPU
GROUPED_EXPERIMENTS = ("grouped_skew", "moe_layer", "moe_train", "fp8_grouped")
# figure script (paper/figures/<name>.py) -> the results it draws; the two diagrams draw what the code does,
# on no measured data. The hero figure also draws grouped_skew where the write-up has it (Plan.figure_inputs).
FIGURE_INPUTS = {
    "e1_compile_modes": ["compile_modes"],
    "e3_epilogue_fusion": ["epilogue_fusion"],
    "e4_split_sweep": ["split_sweep"],
    "e5_decompose_k_grid": ["decompose_k_grid"],
    "e6_router_gemm": ["router_gemm"],
    "e7_grouped_skew": ["grouped_skew"],
    "e8_moe_layer": ["moe_layer"],
    "e9_moe_train": ["moe_train"],
    "hero": ["decompose_k_grid"],
    "diagram_reduction": [],
    "diagram_grouped": [],
}
HERO_OPTIONAL = ["grouped_skew"]
# Figures that also draw the seed's published H100 numbers (results/reference/seed-h100/, as its repository
# has them)
SEED_REFERENCE = "results/reference/seed-h100"
FIGURE_REFERENCES = {
    "e3_epilogue_fusion": [f"{SEED_REFERENCE}/original_triton/epilogue_relu_bf16.csv"],
    "e5_decompose_k_grid": [f"{SEED_REFERENCE}/optimized_triton_tlx/epilogue_relu_bf16.csv"],
}


@dataclass(frozen=True)
class Plan:
    """The pipeline on one machine: its GPUs (none: verify under the interpreter and rebuild the write-up
    from the committed results), where it verifies and measures into (``here``) and where the write-up reads
    from (``res``), and which experiments' results the write-up has (``writeup``)."""

    gpus: tuple[str, ...]
    here: str
    res: str
    writeup: tuple[str, ...]

    @property
    def shards(self) -> int:
        """One shard per GPU (1 without a GPU or with one)."""
        return max(1, len(self.gpus))

    @property
    def sharded(self) -> tuple[str, ...]:
        """The experiments run as one shard per GPU and merged on the CPU: the grouped ones, with several
        GPUs; with one, none (each experiment one job like the others)."""
        return GROUPED_EXPERIMENTS if self.shards > 1 else ()

    def figure_inputs(self) -> dict[str, list[str]]:
        """figure -> the results it draws, for this write-up."""
        out = {f: list(needs) for f, needs in FIGURE_INPUTS.items()}
        out["hero"] += [e for e in HERO_OPTIONAL if e in self.writeup]
        return out

    def figures(self) -> list[str]:
        """The figures drawn: those whose results the write-up has."""
        return [f for f, needs in self.figure_inputs().items() if all(n in self.writeup for n in needs)]

    def figure_data(self, res: str, fig: str) -> list[str]:
        """The results (and references) figure ``fig`` draws from results/``res``/."""
        return [f"results/{res}/{name}.csv" for name in self.figure_inputs()[fig]] + FIGURE_REFERENCES.get(
            fig, []
        )

    def banner(self, tex: bool) -> list[str]:
        """What Snakemake says at every start (a dry run included), so that nobody mistakes which GPU the
        write-up shows; and, without latexmk, that the PDF is skipped."""
        if self.gpus:
            said = (
                f"moegemm: {len(self.gpus)} GPU(s) found ({self.gpus[0]}): results go to "
                f"results/{self.here}/; the write-up is built from them."
            )
        else:
            said = (
                "moegemm: no CUDA GPU here. Verifying the kernels under the Triton interpreter; figures, "
                f"tables and paper are rebuilt from the committed results/{self.res}/ (measured on that "
                "GPU). No GPU number is produced on this machine."
            )
        lines = [said]
        if not tex:
            lines.append(
                "moegemm: latexmk not found: the paper PDF is skipped (install TeX Live and latexmk, e.g. "
                "apt-get install latexmk texlive-latex-recommended texlive-latex-extra "
                "texlive-fonts-recommended); everything else is built."
            )
        return lines


def plan(gpus: list[str], committed: str, root: str | Path = ".") -> Plan:
    """The plan for a machine with ``gpus`` (names; [] for none) in the checkout at ``root``: with a GPU every
    experiment is measured and the write-up is built from those results; without one, from the committed
    results of ``committed`` (config["committed_results"]), those experiments whose CSV exists, so that a GPU
    with a partial set of results still builds."""
    res = results_slug(gpus, committed)
    writeup = tuple(e for e in EXPERIMENTS if gpus or (Path(root) / "results" / res / f"{e}.csv").exists())
    return Plan(gpus=tuple(gpus), here=machine_slug(gpus), res=res, writeup=writeup)


def source_files(root: str | Path = ".") -> list[str]:
    """What the verify step tests: the library's and the tests' Python files and the tests' shared
    conftest.py, named relative to ``root``."""
    root = Path(root)
    tops = [
        name
        for top in ("src", "tests")
        for name in sorted(str(p.relative_to(root)) for p in (root / top).rglob("*.py"))
    ]
    return tops + (["conftest.py"] if (root / "conftest.py").is_file() else [])
