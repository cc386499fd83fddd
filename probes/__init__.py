"""One-off investigations the write-up cites but the pipeline does not run: each probe answers one question
about a kernel or a measurement, on the GPU, and writes results/<gpu>/probe_*.csv. They reuse the
experiments' code; nothing outside probes/ imports them, their tests included (probes/tests/, which the
README's test command runs); the write-up reads their CSVs (``paper.numbers.probes``).

    python -m probes.<probe> --out results/<gpu-slug>/<probe>.csv
"""
