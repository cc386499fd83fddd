"""One module per experiment (E1..E8): each a CLI that reads experiments/config.yaml, runs, writes a CSV."""
