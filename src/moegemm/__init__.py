"""moegemm: Triton kernels for the two GEMMs of a mixture-of-experts layer that ordinary tiling serves badly.

- :mod:`moegemm.decompose_k` -- skinny, long-K GEMMs (the MoE router) split over K.
- :mod:`moegemm.grouped` -- grouped expert GEMMs with data-dependent row counts.

The library reads its own packaged tuning tables, and keeps the choices its first calls time for shapes
those tables lack in a cache file (see :mod:`moegemm.autotune`); it performs no other file I/O.
"""

__version__ = "0.1.0"
