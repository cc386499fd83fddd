"""The figures: one script per experiment (and two diagrams), reading results/<gpu>/ and writing PDF (paper)
+ PNG (README) into figures/<gpu>/."""
