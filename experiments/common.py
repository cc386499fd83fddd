"""What every experiment CLI shares: config, output paths, resumable atomic CSV writing, inputs, floors."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

import torch
import yaml

from experiments._io import atomic_path, write_json

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_config(path: str | os.PathLike = ROOT / "experiments" / "config.yaml") -> dict:
    cfg = yaml.safe_load(Path(path).read_text())
    try:
        import jsonschema
    except ImportError:  # the GPU image may lack it; the pipeline validates with Snakemake first
        return cfg
    schema = yaml.safe_load((ROOT / "experiments" / "config.schema.yaml").read_text())
    jsonschema.validate(cfg, schema)
    return cfg


def cli(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="CSV to write (atomically, when every row is done)")
    ap.add_argument("--config", default=str(ROOT / "experiments" / "config.yaml"))
    ap.add_argument(
        "--shard",
        default="0/1",
        type=parse_shard,
        help="I/N: only shard I of N (0-based) of the cells, whole models each (E7, E8); the pipeline "
        "runs one shard per GPU and merges them",
    )
    return ap.parse_args()


def parse_shard(spec: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N."""
    try:
        i, n = (int(v) for v in str(spec).split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard: expected I/N, got {spec!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard: expected 0 <= I < N, got {spec!r}")
    return i, n


def selected(chosen, model: str) -> bool:
    """Whether a run's model selection ``chosen`` (None: no selection, every model) takes ``model``."""
    return chosen is None or model in chosen


def check_models(chosen, allowed, key: str, kind: str = "zoo models") -> None:
    """Refuse a run's model selection ``chosen`` (None: no selection) that names a model outside ``allowed``,
    with a ValueError naming the config ``key``."""
    unknown = sorted(set(chosen or ()) - set(allowed))
    if unknown:
        raise ValueError(f"{key}: not {kind}: {unknown}")


def shard_cells(cells: list[tuple], shard: tuple[int, int]) -> list[tuple]:
    """The cells (tuples, the model first) of shard I of N, in their order. Each model's cells stay in one
    shard (its weights and compiled graphs are built once); the models go, most cells first, to the shard with
    the fewest cells so far, so that the shards are about as long."""
    i, n = shard
    if n == 1:
        return list(cells)
    per_model: dict = {}
    for c in cells:
        per_model[c[0]] = per_model.get(c[0], 0) + 1
    load, owner = [0] * n, {}
    for model, count in sorted(per_model.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        j = min(range(n), key=lambda s: (load[s], s))
        owner[model] = j
        load[j] += count
    return [c for c in cells if owner[c[0]] == i]


# Set to 1 by a caller that removes ``<out>.partial`` itself once it has recorded the step as done
# (experiments/device_pipeline.sh): a step stopped between its CSV and that record (Snakemake then removes
# the CSV of the job it was interrupted in) still resumes from its rows instead of measuring them again.
KEEP_PARTIAL = "MOEGEMM_KEEP_PARTIAL"


class ResultWriter:
    """Long-form rows, appended to ``<out>.partial`` as each unit finishes (so a killed run resumes where
    it stopped), renamed into place atomically by :meth:`finish` when all are done (which removes the
    ``.partial`` log, unless KEEP_PARTIAL is set)."""

    def __init__(self, out: str | os.PathLike, key_fields: tuple[str, ...]):
        self.out = Path(out)
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.key_fields = key_fields
        self.rows: list[dict] = []
        if self.partial.exists():
            with self.partial.open() as f:
                self.rows = [json.loads(line) for line in f if line.strip()]
            print(f"resuming {self.out}: {len(self.rows)} rows already done", file=sys.stderr)
        self._done = {self._key(r) for r in self.rows}

    def _key(self, row: dict) -> tuple:
        return tuple(str(row.get(k)) for k in self.key_fields)

    def done(self, **key) -> bool:
        return tuple(str(key.get(k)) for k in self.key_fields) in self._done

    def add(self, rows: list[dict]) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with self.partial.open("a") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows += rows
        self._done |= {self._key(r) for r in rows}

    def finish(self) -> None:
        fields: list[str] = []
        for r in self.rows:
            fields += [k for k in r if k not in fields]
        with atomic_path(self.out) as tmp, tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(self.rows)
        if os.environ.get(KEEP_PARTIAL) != "1":
            self.partial.unlink(missing_ok=True)
        print(f"wrote {self.out} ({len(self.rows)} rows)", file=sys.stderr)


def config_cell(value) -> dict:
    """A config column as a dict: rows resumed from a .partial log hold dicts, rows read back from a CSV
    hold their Python repr."""
    import ast

    return value if isinstance(value, dict) else ast.literal_eval(value)


def best_rows(rows: list[dict], key) -> dict:
    """{key(row): the fastest correct row on the GPU clock} over a tuner's rows."""
    best: dict = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        k = key(r)
        if k not in best or float(r["graph_us"]) < float(best[k]["graph_us"]):
            best[k] = r
    return best


def write_table(family: str, slug: str, entries: list[dict]) -> Path:
    """Write a tuned table the library reads (src/moegemm/tuned/<family>/<slug>.json), with provenance."""
    table = ROOT / "src" / "moegemm" / "tuned" / family / f"{slug}.json"
    write_json(
        table,
        {
            "gpu": torch.cuda.get_device_name(0),
            "clock": "CUDA-graph replay",
            "provenance": provenance_fields(),
            "entries": entries,
        },
    )
    print(f"wrote {table} ({len(entries)} entries)")
    record_hardware(slug)
    return table


def record_hardware(slug: str) -> None:
    """Put this GPU's traits (moegemm._runtime.device_traits) into the library's hardware.json under
    ``slug``, beside the other cards' (the library finds the table that serves a card through them)."""
    from moegemm._runtime import device_traits

    path = ROOT / "src" / "moegemm" / "tuned" / "hardware.json"
    doc = json.loads(path.read_text())
    doc["gpus"][slug] = {"name": torch.cuda.get_device_name(0), **device_traits(0).as_dict()}
    doc["gpus"] = dict(sorted(doc["gpus"].items()))
    write_json(path, doc)


PROVENANCE_KEYS = ("gpu", "sm_count", "driver", "cuda", "torch", "triton", "git_commit", "git_dirty", "utc")


def provenance_fields() -> dict:
    from experiments.harness.provenance import provenance

    p = provenance()
    return {k: p[k] for k in PROVENANCE_KEYS}


def require_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("this experiment measures a GPU; none is visible here (no number is faked on a CPU)")


def timing_settings(cfg: dict, section: str | None = None):
    """The timing settings: config.yaml's ``timing``, or ``<section>.timing`` where that section has its
    own."""
    from experiments.harness.runner import Settings

    t = dict(cfg.get(section, {}).get("timing") or cfg["timing"])
    return Settings(**t)


def weight_sets(w: torch.Tensor, active: int, rows: int, k: int, n: int) -> list[torch.Tensor]:
    """w and enough copies of it that one pass over the active experts' weights (plus the activations)
    exceeds twice the L2."""
    from experiments.harness.timing import input_sets_for

    sets = input_sets_for(2 * (active * k * n + rows * (k + n)))
    return [w] + [w.clone() for _ in range(sets - 1)]


def check_call(calls: list, ref: torch.Tensor | None, k: int, check_fn=None) -> dict:
    """{status, rel_err, note} of a candidate's first call against the float64 reference (or ``check_fn``);
    an error (e.g. a tile that needs more shared memory than the GPU has) is recorded, not raised."""
    from experiments.harness.correctness import check, status_of

    try:
        out = calls[0]()
        ok, rel, why = check_fn(out) if check_fn is not None else check(out, ref, k)
    except Exception as ex:
        ok, rel, why = False, float("nan"), f"error: {type(ex).__name__}: {str(ex)[:160]}"
    return {"status": status_of(ok, why), "rel_err": rel, "note": why}


def check_and_time(calls: list, ref: torch.Tensor | None, k: int, settings, check_fn=None) -> dict:
    """A tuner's verdict on one candidate: its first call checked against the float64 reference (an error,
    e.g. a tile that needs more shared memory than the GPU has, is recorded), then, if right, the median of
    3 CUDA-graph samples of ``calls`` (one call per rotated input set), as many calls per graph as
    ``settings`` (a experiments.harness.runner.Settings) gives: calls_per_graph, fewer for a kernel of
    milliseconds where it has min_graph_us. ``check_fn(out) -> (ok, rel_err, why)``: a check of its own, in
    place of the comparison with ``ref``."""
    import statistics

    from experiments.harness.runner import graph_timer

    row = check_call(calls, ref, k, check_fn)
    if row["status"] == "ok":
        timer = graph_timer(calls, settings)
        row["graph_us"] = statistics.median(timer.sample(3))
        row["graph_calls"] = timer.n
    return row


def ref64(a: torch.Tensor, b: torch.Tensor, epilogue: str = "none", bias=None) -> torch.Tensor:
    """The float64 reference, computed on the operands' device."""
    from moegemm.decompose_k.reference import reference_mm

    return reference_mm(a, b, epilogue, bias, on_cpu=False)


def raise_recompile_limit(n: int) -> None:
    """Dynamo's per-code-object recompile limit (``recompile_limit``; ``cache_size_limit`` before 2.6)."""
    import torch._dynamo.config as dc

    for name in (
        "recompile_limit",
        "cache_size_limit",
        "accumulated_recompile_limit",
        "accumulated_cache_size_limit",
    ):
        if hasattr(dc, name):
            setattr(dc, name, max(n, getattr(dc, name)))


class Progress:
    """A progress bar (tqdm when present) on stderr."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, mininterval=2.0)
        except ImportError:
            self.bar = None

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
