"""The generated numbers and tables of the write-up, one module per experiment (e1..e7, e7_probes) and
one of shared helpers (common); paper/make_numbers.py is the command that writes them."""
