"""The two diagrams (paper/figures/diagram_reduction.py, paper/figures/diagram_grouped.py): they build on the
CPU through the figures' command line, read no measured data, print legibly at the paper's width, name only
what the code names, and the grouped diagram's example is what route() and the kernels' tile map compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paper.figures import diagram_grouped, diagram_reduction

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["diagram_reduction", "diagram_grouped"])
def test_diagram_builds_from_no_results(tmp_path, name):
    """`python -m paper.figures.<name> --results <a folder that does not exist> --out ...`, traced: a PDF and
    a PNG of a few tens of kB, and nothing read but code (no CSV or JSON). Without a GPU the library's
    kernels run under Triton's interpreter, as on a machine with none; with one, on it, as the pipeline
    runs there."""
    out = tmp_path / "figs" / name
    record = tmp_path / "record.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "MPLBACKEND": "Agg"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    res = subprocess.run(
        [sys.executable, "-m", "paper.manifest", "trace", "--record", str(record), "--"]
        + [f"paper.figures.{name}", "--results", str(tmp_path / "no-results"), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    pdf, png = out.with_suffix(".pdf").read_bytes(), out.with_suffix(".png").read_bytes()
    assert pdf.startswith(b"%PDF-") and len(pdf) > 10_000
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert 750 <= width <= 1000 and 300 <= height <= 600, (width, height)  # 120 dpi, about 7 x 3.5 in
    rec = json.loads(record.read_text())
    assert rec["inputs"] == {}, rec["inputs"]  # the outputs are outside the checkout: not recorded
    assert f"paper/figures/{name}.py" in rec["code"] and "paper/figures/diagrams.py" in rec["code"]
    if name == "diagram_grouped":  # the example is the library's: its routing and tile code ran
        assert {"src/moegemm/grouped/routing.py", "src/moegemm/grouped/tiles.py"} <= set(rec["code"])


@pytest.mark.parametrize("module", [diagram_reduction, diagram_grouped])
def test_diagram_prints_legibly_at_the_paper_width(module):
    """At the paper's text width no text prints below 7 pt and nothing lies outside the figure."""
    from paper.figures import common

    fig = module.draw(module.example()) if hasattr(module, "example") else module.draw()
    smallest, panels = common.print_check(fig)
    assert smallest >= common.MIN_PT and panels == 1, (smallest, panels)
    renderer = fig.canvas.get_renderer()
    w, h = fig.get_size_inches() * fig.dpi
    for t in fig.axes[0].texts:
        bb = t.get_window_extent(renderer)
        assert bb.x0 >= -0.5 and bb.x1 <= w + 0.5 and bb.y0 >= -0.5 and bb.y1 <= h + 0.5, t.get_text()


def test_reduction_diagram_names_what_the_kernel_names():
    """Every code name the reduction diagram uses is in the kernel's source, and the diagram draws them."""
    src = (ROOT / "src" / "moegemm" / "decompose_k" / "single_launch.py").read_text()
    missing = [n for n in diagram_reduction.NAMES if n not in src]
    assert not missing, missing
    fig = diagram_reduction.draw()
    text = "\n".join(t.get_text() for t in fig.axes[0].texts).replace("\n", " ")
    unused = [n for n in diagram_reduction.NAMES if n not in text and n != "_single_launch_kernel"]
    assert not unused, unused


def test_grouped_example_is_what_route_and_the_tile_map_compute():
    """The example the diagram draws: route()'s plan for its ids (one empty expert, one hot one), and a tile
    table that covers every expert's rows, column tile by column tile, exactly once, in expert order, with
    the programs past the tile count left idle; the masked layout's tiles lie below masked_m."""
    from moegemm.grouped import route

    ex = diagram_grouped.example()
    ids = torch.tensor(ex["topk_ids"], dtype=torch.int32)
    plan = route(ids, ex["num_experts"])
    assert ex["group_sizes"] == plan.group_sizes.tolist()
    assert ex["group_offsets"] == plan.group_offsets.tolist()
    assert ex["sorted_token_ids"] == plan.sorted_token_ids.tolist()
    assert ex["sorted_slot"] == plan.sorted_slot.tolist()
    # the plan, checked from the ids themselves: counts, offsets, grouped by expert in token order
    counts = torch.bincount(ids.flatten().long(), minlength=ex["num_experts"]).tolist()
    assert ex["group_sizes"] == counts and 0 in counts and max(counts) > 2 * sum(counts) / len(counts)
    flat = ids.flatten().tolist()
    want = sorted(range(len(flat)), key=lambda s: (flat[s], s))
    assert ex["sorted_slot"] == want and ex["sorted_token_ids"] == [s // ids.shape[1] for s in want]

    bm, bn, n, E = ex["block_m"], ex["block_n"], ex["n"], ex["num_experts"]
    off = ex["group_offsets"]
    covered = []
    for t in ex["tiles"]:
        e = t["expert"]
        assert (t["row_start"], t["row_end"]) == (off[e], off[e + 1])
        assert off[e] <= t["row0"] < off[e + 1] and t["col0"] % bn == 0
        covered += [
            (r, c)
            for r in range(t["row0"], min(t["row0"] + bm, t["row_end"]))
            for c in range(t["col0"], t["col0"] + bn)
        ]
    assert sorted(covered) == [(r, c) for r in range(off[-1]) for c in range(n)]  # each element once
    assert [t["expert"] for t in ex["tiles"]] == sorted(t["expert"] for t in ex["tiles"])
    assert [t["program"] for t in ex["tiles"]] == list(range(len(ex["tiles"])))  # one tile per program
    assert ex["programs"] == (-(-off[-1] // bm) + E) * -(-n // bn) > len(ex["tiles"])
    tiles_of = {e: -(-s // bm) * (n // bn) for e, s in enumerate(ex["group_sizes"])}
    assert len(ex["tiles"]) == sum(tiles_of.values())

    masked = ex["masked_tiles"]
    assert ex["m_max"] == max(ex["group_sizes"]) and ex["masked_programs"] == E * -(-ex["m_max"] // bm) * (
        n // bn
    )
    assert [(t["expert"], t["row0"], t["col0"]) for t in masked] == [
        (t["expert"], t["row0"] - t["row_start"], t["col0"]) for t in ex["tiles"]
    ]  # the same tiles, numbered the same, each expert's rows from 0 of its own block
    assert all(t["row_start"] == 0 and t["row_end"] == ex["group_sizes"][t["expert"]] for t in masked)
