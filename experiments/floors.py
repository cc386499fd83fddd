"""Floors measured on this GPU: one tiny kernel's CUDA-graph time, device copy bandwidth (read+write), the
bandwidth of a streaming read (a sum over 4 GiB) and a large bf16 matmul rate, beside the datasheet peaks
that the figures draw.

    python -m experiments.floors --out results/<slug>/floors.json
"""

from __future__ import annotations

import argparse

from experiments.common import provenance_fields, require_gpu, write_json
from experiments.harness.floors import datasheet, measure
from moegemm._runtime import slugify


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    require_gpu()
    prov = provenance_fields()
    m = measure()
    write_json(args.out, {"measured": m, "datasheet": datasheet(slugify(prov["gpu"])), "provenance": prov})
    print(m)


if __name__ == "__main__":
    main()
