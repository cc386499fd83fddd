"""The generated numbers and tables of the write-up, one module per experiment (e1..e8, e7_heldout, e7_tuner,
runtime, readme) and one of shared helpers (common); the probes' are in probes/writeup.py.
paper/make_numbers.py is the command that writes them."""
