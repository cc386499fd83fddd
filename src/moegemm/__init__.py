"""moegemm: Triton kernels for the two GEMMs of a mixture-of-experts layer that ordinary tiling serves badly.

- :mod:`moegemm.decompose_k` -- skinny, long-K GEMMs (the MoE router) split over K.
- :mod:`moegemm.grouped` -- grouped expert GEMMs with data-dependent row counts.

The library performs no file I/O except reading its own packaged tuning tables.
"""

__version__ = "0.1.0"
