"""Our kernels inside other libraries' models (optional: each integration imports its library on use)."""
