"""One-off investigations the write-up cites but the pipeline does not run: each probe answers one question
about a kernel or a measurement, on the GPU, and writes results/<gpu>/probe_*.csv. They reuse the
experiments' code (``experiments`` never imports them); their numbers come from ``probes.writeup`` and their
tests live in tests/probes/.

    python -m probes.<probe> --out results/<gpu-slug>/<probe>.csv
"""
