"""The generated numbers and tables of the write-up, one module per experiment (e1..e8, e7_heldout, e7_tuner,
runtime, readme), the probes' (probes) and the shared helpers (common, latex).
paper/make_numbers.py is the command that writes them."""
