"""Figures: one script per experiment, reading results/<gpu>/ and writing PDF (paper) + PNG (README)."""
