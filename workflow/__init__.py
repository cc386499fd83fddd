"""The pipeline's own code: the Snakemake rules (workflow/rules/*.smk, by stage) and the plan they follow
(workflow/plan.py)."""
