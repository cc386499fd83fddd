"""The measuring harness's CPU-testable parts: resumable atomic CSVs, clocks, code inspection, pipeline."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from experiments.common import ResultWriter
from experiments.pipeline import CPU_SLUG, machine_slug, results_slug
from moegemm.bench.timing import Clock
from moegemm.inductor.codegen import inspect


def test_result_writer_resumes_and_writes_atomically(tmp_path):
    out = tmp_path / "r" / "x.csv"
    w = ResultWriter(out, ("m",))
    w.add([{"m": 1, "v": 0.5}])
    assert not out.exists(), "nothing is published before finish()"
    # A killed run: a new writer resumes from the partial log and skips what is done.
    w2 = ResultWriter(out, ("m",))
    assert w2.done(m=1) and not w2.done(m=2)
    w2.add([{"m": 2, "v": 0.25, "extra": "y"}])
    w2.finish()
    rows = list(csv.DictReader(out.open()))
    assert [(r["m"], r["v"], r["extra"]) for r in rows] == [("1", "0.5", ""), ("2", "0.25", "y")]
    assert not (tmp_path / "r" / "x.csv.partial").exists()
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["x.csv"]  # no temp files left behind


def test_atomic_path_leaves_old_file_on_failure(tmp_path):
    from experiments._io import atomic_path

    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_clock_quantiles():
    c = Clock.of([float(x) for x in range(1, 11)])
    assert c.median_us == 5.5 and c.samples == 10 and c.p20_us < c.median_us < c.p80_us
    assert Clock.of([]).samples == 0


GPU_DK = """
def triton_per_fused_sum_0(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
def triton_poi_fused_relu_1(in_out_ptr0, xnumel):
    pass
def call(args):
    buf0 = empty_strided_cuda((32, 16, 16), (256, 16, 1), torch.float32)
    extern_kernels.bmm(reinterpret_tensor(arg0_1, (32, 16, 256), (256, 8192, 1), 0), arg1_1, out=buf0)
    buf1 = empty_strided_cuda((16, 16), (16, 1), torch.bfloat16)
    triton_per_fused_sum_0.run(buf0, buf1, 256, 32, stream=stream0)
    triton_poi_fused_relu_1.run(buf1, 256, stream=stream0)
"""
GPU_TEMPLATE = """
def triton_tem_fused_mm_relu_0(arg_A, arg_B, out_ptr0):
    pass
def call(args):
    buf0 = empty_strided_cuda((16, 16), (16, 1), torch.bfloat16)
    triton_tem_fused_mm_relu_0.run(arg0_1, arg1_1, buf0, stream=stream0)
"""


def test_inspect_inductor_code():
    dk = inspect(GPU_DK, 16, 16)
    assert dk["decompose_k"] and dk["split_k"] == 32 and dk["relu"] == "separate-kernel"
    assert dk["kernels"] == ["triton_per_fused_sum_0", "triton_poi_fused_relu_1"]
    assert dk["extern_calls"] == ["bmm"] and dk["n_kernel_launches"] == 3
    t = inspect(GPU_TEMPLATE, 16, 16)
    assert not t["decompose_k"] and t["mm_template"] and t["relu"] == "fused-into-mm-template"
    assert t["n_kernel_launches"] == 1


@pytest.mark.long
def test_inspect_real_cpu_compile():
    """What Inductor really emits (CPU backend) for the seed's decomposeK + ReLU: bmm + one fused kernel."""
    import torch

    from moegemm.inductor.codegen import run_and_get_code
    from moegemm.inductor.custom_op import decompose_k_relu_impl

    torch._dynamo.reset()
    a, b = torch.randn(16, 2048), torch.randn(2048, 8)
    out, code, _ = run_and_get_code(torch.compile(lambda x, y: decompose_k_relu_impl(x, y, 16)), a, b)
    torch.testing.assert_close(out, torch.relu(a @ b), rtol=1e-4, atol=1e-4)
    info = inspect(code, 16, 8)
    assert info["decompose_k"] and info["split_k"] == 16 and info["relu"] == "fused-into-reduction", info


def test_pipeline_slugs():
    assert machine_slug([]) == CPU_SLUG
    assert machine_slug(["NVIDIA H200", "NVIDIA H200"]) == "nvidia-h200"
    assert results_slug([], "nvidia-h200") == "nvidia-h200"
    assert results_slug(["NVIDIA H100 80GB HBM3"], "nvidia-h200") == "nvidia-h100-80gb-hbm3"


def test_config_validates():
    from experiments.common import load_config

    cfg = load_config()
    assert cfg["committed_results"] and cfg["decompose_k"]["grid_k"][0] == 8192
    import jsonschema
    import yaml

    from experiments.common import ROOT

    schema = yaml.safe_load((ROOT / "experiments" / "config.schema.yaml").read_text())
    bad = json.loads(json.dumps(cfg))
    bad["timing"]["rounds"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_provenance_prefers_the_shipped_commit_record(monkeypatch):
    """A commit recorded by whoever shipped the tree wins over a (possibly stale) .git found there."""
    from moegemm.bench import provenance as prov

    prov._static.cache_clear()
    monkeypatch.setenv("MOEGEMM_COMMIT", "abc1234")
    monkeypatch.setenv("MOEGEMM_DIRTY", "0")
    try:
        info = prov.provenance()
        assert info["git_commit"] == "abc1234" and info["git_dirty"] is False
        prov._static.cache_clear()
        monkeypatch.setenv("MOEGEMM_DIRTY", "1")
        assert prov.provenance()["git_dirty"] is True
        prov._static.cache_clear()
        monkeypatch.delenv("MOEGEMM_COMMIT")
        monkeypatch.delenv("MOEGEMM_DIRTY")
        head = prov._git("rev-parse", "HEAD")
        assert prov.provenance()["git_commit"] == (head or "unknown")
    finally:
        prov._static.cache_clear()


def _tuner_cell(device):
    """(routing plan, sorted fp32 rows, fp32 weights [E, N, K]) of the tuner tests' small cell: 12 tokens,
    top-2 of 4 experts, K = 32, N = 48, seed 0."""
    import torch

    from moegemm.grouped import permute, route

    torch.manual_seed(0)
    e, k, n = 4, 32, 48
    plan = route(torch.stack([torch.randperm(e)[:2] for _ in range(12)]).to(device), e)
    return plan, permute(torch.randn(12, k).to(device), plan), torch.randn(e, n, k).to(device)


def _fake_graph_timers(monkeypatch, sample_us):
    """GraphTimer faked on the CPU: (timers made, in order; the timer ids in the order they were sampled).
    ``sample_us(timer_id, samples_so_far)`` is the value a sample returns."""
    made, order = [], []

    class FakeTimer:
        def __init__(self, calls, n):
            self.calls, self.id, self.n = calls, len(made), n
            made.append(self)

        def sample(self, n):
            order.append(self.id)
            return [sample_us(self.id, len(order))] * n

    monkeypatch.setattr("moegemm.bench.timing.GraphTimer", FakeTimer)
    return made, order


def test_grouped_tuner_times_tiles_then_the_best_on_the_persistent_grid(tmp_path, monkeypatch, device):
    """tune_grouped's cell: every plain-grid tile config checked against float64 and timed side by side
    (SCREEN_ROUNDS rounds of one replay each, who goes first rotating), configs done already skipped, then
    the fastest few again on the persistent grid (GPU clock faked on the CPU)."""
    import dataclasses


    import experiments.tune_grouped as tg
    from experiments.e7_grouped_skew import ref_rows
    from moegemm.grouped import GroupedConfig

    fake = iter(range(100, 1000))
    made, order = _fake_graph_timers(monkeypatch, lambda timer, count: float(next(fake)))
    plan, xs, w = _tuner_cell(device)
    ref = ref_rows(xs, w, plan.group_offsets)
    writer = ResultWriter(tmp_path / "t.csv", ("model", "proj", "tokens", "config"))
    base = {"model": "m", "proj": "up", "tokens": 12}
    cfgs = [GroupedConfig(16, 16, 16), GroupedConfig(16, 32, 16), GroupedConfig(32, 16, 32, num_warps=2)]
    writer.add(tg.time_configs(cfgs[:1], writer, base, xs, [w], plan.group_offsets, ref))
    rows = tg.time_configs(cfgs, writer, base, xs, [w], plan.group_offsets, ref)
    assert [GroupedConfig(**r["config"]) for r in rows] == cfgs[1:]  # the first was done already
    first = len(made) - 2  # the two timed here
    assert order[-2 * tg.SCREEN_ROUNDS:] == [first + (r + j) % 2 for r in range(tg.SCREEN_ROUNDS) for j in range(2)]
    assert all(r["status"] == "ok" and r["graph_us"] >= 100 for r in rows)
    best = sorted(writer.rows + rows, key=lambda r: r["graph_us"])[: tg.PERSISTENT_TRIES - 1]
    more = tg.time_configs([dataclasses.replace(GroupedConfig(**r["config"]), persistent=True) for r in best],
                           writer, base, xs, [w], plan.group_offsets, ref)
    assert [GroupedConfig(**r["config"]).persistent for r in more] == [True, True]


def test_grouped_tuner_screens_a_whole_load_in_one_batch_unless_memory_is_short(tmp_path, monkeypatch, device):
    """Every config of a screen call is timed in one side-by-side batch (nine configs here: more than the
    old batches of eight), its rounds rotating over all of them; screen_batch shrinks the batch to what
    SCREEN_MEMORY of the free memory holds (never below two)."""
    import experiments.tune_grouped as tg
    from experiments.e7_grouped_skew import ref_rows
    from moegemm.grouped import GroupedConfig

    made, order = _fake_graph_timers(monkeypatch, lambda timer, count: 100.0 + timer)
    plan, xs, w = _tuner_cell(device)
    cfgs = [GroupedConfig(16, bn, bk, num_stages=st)
            for bn in (16, 32, 64) for bk in (16, 32) for st in (2, 3)][:9]
    writer = ResultWriter(tmp_path / "t.csv", ("model", "proj", "tokens", "config"))
    rows = tg.time_configs(cfgs, writer, {"model": "m", "proj": "up", "tokens": 12}, xs, [w],
                           plan.group_offsets, ref_rows(xs, w, plan.group_offsets))
    assert len(made) == 9 and [r["graph_us"] for r in rows] == [100.0 + i for i in range(9)]
    assert order == [(r + j) % 9 for r in range(tg.SCREEN_ROUNDS) for j in range(9)]
    graph = 2 * (1 << 30) + (64 << 20)  # a 1 GiB output, counted twice, and 64 MiB
    assert tg.screen_batch(1 << 30, free_bytes=100 * graph) == min(tg.SCREEN_BATCH, 50)
    assert tg.screen_batch(1 << 30, free_bytes=20 * graph) == 10
    assert tg.screen_batch(1 << 30, free_bytes=graph) == 2


def test_grouped_tuner_final_round_times_the_finalists_side_by_side(monkeypatch, device):
    """The tuner's final: one graph per finalist, FINAL_ROUNDS interleaved rounds (who goes first rotating),
    FINAL_REPLAYS replays each per round, the median kept per config as a "final" row (GPU clock faked on
    the CPU); the table's choice comes from the final where the cell had one, else from the screen."""

    import experiments.tune_grouped as tg
    from moegemm.grouped import GroupedConfig

    made, order = _fake_graph_timers(monkeypatch, lambda timer, count: 100.0 * (timer + 1) + count)
    plan, xs, w = _tuner_cell(device)
    cfgs = [GroupedConfig(16, 16, 16), GroupedConfig(16, 32, 16), GroupedConfig(32, 16, 32)]
    rows = tg.final_round(cfgs, {"model": "m", "load": "uniform"}, xs, [w], plan.group_offsets)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2][: tg.FINAL_ROUNDS * 3]
    assert [GroupedConfig(**r["config"]) for r in rows] == cfgs
    assert all(r["stage"] == "final" and r["status"] == "ok" and r["load"] == "uniform" for r in rows)
    assert [r["graph_samples"] for r in rows] == [tg.FINAL_ROUNDS * tg.FINAL_REPLAYS] * 3
    # config i's samples: 100 (i + 1) + the call's position; the median of its FINAL_ROUNDS positions
    pos = {i: [j + 1 for j, x in enumerate(order) if x == i] for i in range(3)}
    import statistics
    assert [r["graph_us"] for r in rows] == [100.0 * (i + 1) + statistics.median(pos[i]) for i in range(3)]

    def row(cfg, load, us, stage):
        return {"config": {"block_m": cfg}, "load": load, "graph_us": us, "status": "ok", "stage": stage}

    screen = [row(64, "uniform", 100.0, "screen"), row(64, "zipf1.2", 100.0, "screen"),
              row(128, "uniform", 105.0, "screen"), row(128, "zipf1.2", 104.0, "screen")]
    loads = ("uniform", "zipf1.2")
    assert json.loads(tg.cell_choice(screen, loads)[1])["block_m"] == 64
    final = [row(64, "uniform", 110.0, "final"), row(64, "zipf1.2", 111.0, "final"),
             row(128, "uniform", 101.0, "final"), row(128, "zipf1.2", 102.0, "final")]
    us, best, by_load = tg.cell_choice(screen + final, loads)
    assert json.loads(best)["block_m"] == 128 and by_load == {"uniform": 101.0, "zipf1.2": 102.0}
    assert abs(us - (101.0 * 102.0) ** 0.5) < 1e-9
    assert tg.cell_choice([row(64, "uniform", 1.0, "screen")], loads) is None


def test_grouped_tuner_keeps_the_config_best_over_the_loads():
    """The tuner ranks a cell's configs by their geometric-mean time over the tuning loads: a config fastest
    on the uniform load but slow under skew loses to one good on both; a config wrong (or not timed) under
    one load is not ranked; T=1 is tuned on the uniform load alone; the loads must start with uniform."""
    import experiments.tune_grouped as tg

    def row(cfg, load, us, status="ok"):
        return {"config": {"block_m": cfg}, "load": load, "graph_us": us, "status": status}

    rows = [row(16, "uniform", 100.0), row(16, "zipf1.2", 200.0),   # geomean 141
            row(64, "uniform", 110.0), row(64, "zipf1.2", 120.0),   # geomean 115
            row(32, "uniform", 90.0), row(32, "zipf1.2", 1.0, "wrong"),
            row(128, "uniform", 95.0)]
    order = tg.robust_order(rows, ("uniform", "zipf1.2"))
    assert [json.loads(c)["block_m"] for _, c in order] == [64, 16]
    assert abs(order[0][0] - (110.0 * 120.0) ** 0.5) < 1e-9
    assert [json.loads(c)["block_m"] for _, c in tg.robust_order(rows, ("uniform",))] == [32, 128, 16, 64]
    old = [{k: v for k, v in r.items() if k != "load"} for r in rows if r["load"] == "uniform"]  # pre-load rows
    assert [json.loads(c)["block_m"] for _, c in tg.robust_order(old, ("uniform",))] == [32, 128, 16, 64]
    g = {"tune_loads": ["uniform", "zipf1.2"]}
    assert tg.tune_loads(g, 1) == ("uniform",) and tg.tune_loads(g, 64) == ("uniform", "zipf1.2")
    with pytest.raises(ValueError, match="tune_loads"):
        tg.tune_loads({"tune_loads": ["zipf1.2"]}, 64)


def test_grouped_tuner_candidates_by_regime():
    """Every candidate is a valid config within the shared-memory budget, none twice; split-K only at a
    handful of rows per expert, tail tiles only with TMA loads (16-row ones at decode, merged ones past
    it), both grids offered (the warp-specialized loop exists on the persistent one only)."""
    import dataclasses

    from experiments.tune_grouped import candidates

    for mean in (1, 4, 8, 16, 32, 64, 128, 512, 4096):
        cs = candidates(mean)
        keys = [tuple(sorted(dataclasses.asdict(c).items())) for c in cs]
        assert len(set(keys)) == len(keys) > 0, mean
        for c in cs:
            assert (c.block_m * c.block_k + c.block_k * c.block_n) * 2 * c.num_stages <= 200 * 1024
            assert c.tail_m == 0 or c.tma, (mean, c)
            assert not c.merge_tail or (c.tail_m and mean > 16), (mean, c)
            # decode: 16-row tiles (32 with TMA loads; 64 with TMA loads and 16-row tails for hot experts)
            assert c.block_m <= (16 if not c.tma else 32 if not c.tail_m else 64) or mean > 16, (mean, c)
            assert c.tail_m <= 16 or mean > 16, (mean, c)
            assert not c.flatten or c.persistent
        plain = {dataclasses.replace(c, persistent=False) for c in cs if not c.flatten}
        pers = {dataclasses.replace(c, persistent=False) for c in cs if c.persistent and not c.flatten}
        assert plain == pers, mean  # every tile config on both grids
    assert all(any(c.tail_m for c in candidates(mean)) for mean in (8, 32, 512))
    assert any(c.merge_tail for c in candidates(32))
    # past the middle regime, merged tails only as 32-row tails of 128 x 256 tiles, without warp specialization
    assert {(c.block_m, c.block_n, c.tail_m, c.flatten) for mean in (128, 512) for c in candidates(mean)
            if c.merge_tail} == {(128, 256, 32, False)}



def test_long_tests_head_the_chunks_xdist_deals_out():
    """conftest.spread_long_tests: each test marked long heads one worker's first chunk; the others keep
    their order; no test is lost or doubled; without workers nothing moves."""
    from types import SimpleNamespace

    from tests.conftest import spread_long_tests

    items = [SimpleNamespace(name=f"t{i}", keywords={"long"} if i in (0, 1, 2, 40, 97) else set())
             for i in range(100)]
    names = [it.name for it in items]
    spread_long_tests(items, 1)
    assert [it.name for it in items] == names
    spread_long_tests(items, 8)
    got = [it.name for it in items]
    assert sorted(got) == sorted(names)
    heads = [got[round(j * 100 / 8)] for j in range(5)]
    assert heads == ["t0", "t1", "t2", "t40", "t97"]
    rest = [n for n in got if n not in heads]
    assert rest == [n for n in names if n not in heads]


def test_calls_per_graph_shrink_only_for_long_kernels():
    """Settings.min_graph_us: a kernel of milliseconds gets as few calls per graph as give min_graph_us per
    replay, but never fewer than two or than the input sets it rotates through; short kernels keep
    calls_per_graph; without the setting nothing changes."""
    from moegemm.bench.runner import Settings, fewest_calls

    s = Settings(calls_per_graph=10, min_graph_us=3000)
    assert fewest_calls(2600.0, 1, s) == 2
    assert fewest_calls(10.0, 1, s) == 10
    assert fewest_calls(1000.0, 4, s) == 4
    assert fewest_calls(1000.0, 1, s) == 3
    assert fewest_calls(50_000.0, 1, s) == 2
    assert fewest_calls(1000.0, 16, s) == 10  # more sets than calls: as many calls as before, rotating


def test_calls_per_graph_come_from_the_gpu_time_of_a_first_graph(monkeypatch):
    """runner.graph_timer (GraphTimer faked on the CPU): without min_graph_us one graph of calls_per_graph
    calls; with it, a first graph of one call per input set (at least two) whose replayed GPU time, not the
    host's time of a call, sets the number; that graph kept where the number is its own."""
    import time

    from moegemm.bench import timing
    from moegemm.bench.runner import Settings, graph_timer

    made = []

    class FakeTimer:
        gpu_us = 10.0

        def __init__(self, calls, n):
            self.calls, self.n = calls, n
            made.append(self)

        def sample(self, replays):
            return [FakeTimer.gpu_us] * replays

    monkeypatch.setattr(timing, "GraphTimer", FakeTimer)
    slow_host = [lambda: time.sleep(0.004)]  # 4 ms of Python per call: the old host-timed count gave 2 calls
    t = graph_timer(slow_host, Settings(calls_per_graph=7))
    assert t.n == 7 and len(made) == 1
    made.clear()
    t = graph_timer(slow_host, Settings(calls_per_graph=10, min_graph_us=3000))
    assert [m.n for m in made] == [2, 10] and t is made[-1]  # 10 us of GPU time: all 10 calls
    made.clear()
    FakeTimer.gpu_us = 2600.0
    t = graph_timer(slow_host * 3, Settings(calls_per_graph=10, min_graph_us=3000))
    assert [m.n for m in made] == [3] and t is made[0]  # milliseconds: the first graph's count, kept


def _small_moe_cell(device, seed: int, e: int, k: int, n: int, t: int, top_k: int = 2):
    """(routing plan, sorted bf16 rows, bf16 weights [E, N, K], float64 reference) of a small random MoE cell."""
    import torch

    from experiments.e7_grouped_skew import ref_rows
    from moegemm.grouped import permute, route

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(device)
    plan = route(ids, e)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16).to(device)
    xs = permute(x, plan)
    return plan, xs, w, ref_rows(xs, w, plan.group_offsets)


def test_persistent_grid_probe_forces_the_grid_and_checks_every_contender(device):
    """The probe's contenders (plain grid, persistent and masked grids of 1, 2 and the library's number of
    programs per SM) each compute the grouped product (checked against float64 on fresh data), record the
    programs per SM they launched with, and leave the library's own sizing in place afterwards."""

    from experiments import probe_persistent_grid as probe
    from moegemm.bench.correctness import check
    from moegemm.grouped import contiguous, launch

    e, k, n = 4, 64, 48
    plan, xs, w, ref = _small_moe_cell(device, 5, e, k, n, t=7)
    cs = probe.contenders(xs, plan, ref, k, True, e, n)
    assert [c.name for c in cs] == ["plain", "persistent:1", "persistent:2", "persistent:auto",
                                    "masked:1", "masked:2", "masked:auto"]
    for c in cs:
        out = c.bind((xs, w))()
        ok, rel, why = c.check(out) if c.check else check(out, ref, k)
        assert ok, (c.name, why)
        forced = c.name.rsplit(":", 1)[-1]
        if forced in ("1", "2"):
            assert c.fields["per_sm"] == int(forced)
        elif forced == "auto":
            assert c.fields["per_sm"] in (1, 2)
        assert launch.per_sm is probe.SHIPPED and contiguous._plan_key is probe.SHIPPED_PLAN_KEY


def test_prefill_tiles_probe_contenders_compute_their_products(device, monkeypatch):
    """The prefill probe's contenders: the tuned tiles with tails of their own and merged, on [E, K, N]
    weights, and 128 x 128 x 128 tiles
    compute the grouped product, the two dense yardsticks (cuBLAS, our kernel with one expert) the product
    with expert 0's weights, and the even deal of the rows (9 x 2 rows, 4 per expert and the last expert 6)
    its own grouped product, each checked against float64 on fresh data; a variant gives up a stage where
    its shared memory would not fit, and a pointer-load config has none."""

    from experiments import probe_prefill_tiles as probe
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    e, k, n = 4, 64, 48
    plan, xs, w, ref = _small_moe_cell(device, 11, e, k, n, t=9)
    dense = xs.double() @ w[0].double().T
    tuned = GroupedConfig(64, 16, 32, num_stages=3, tma=True)
    monkeypatch.setattr(probe, "choose_config", lambda *a: (tuned, "test"))
    cs = probe.contenders(xs, plan, dense, k, e, n, w)
    assert [c.name for c in cs] == ["tuned", "tuned:separate-tails", "tuned:merged-tails", "tuned:kn",
                                    "tile:128x128x128", "dense:cublas", "dense:ours", "even:ours"]
    assert [(c.config["tail_m"], c.config["merge_tail"]) for c in cs if "tails" in c.name] == [(32, False),
                                                                                            (32, True)]
    for c in cs:
        out = c.bind((xs, w))()
        ok, rel, why = c.check(out) if c.check else check(out, ref, k)
        assert ok, (c.name, why)
    big = GroupedConfig(128, 256, 64, num_warps=8, num_stages=4, persistent=True, tma=True, flatten=True)
    assert probe.variant(big) == big
    assert probe.variant(big, tail_m=64, merge_tail=True).num_stages == 3
    assert probe.variant(GroupedConfig(), tail_m=32) is None


def test_mixed_order_probe_contenders_compute_their_products(device, monkeypatch):
    """The mixed-order probe's contenders: the tuned config, it in expert order and mixed at 2 and 4 row
    tiles (only the orders the tuned config is not), compute the grouped product, and the even deal of the
    rows its own, each with its wave-model time; a tuned config that cannot mix (pointer loads) gets only
    the tuned and even contenders."""
    from experiments import probe_mixed_order as probe
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    e, k, n = 4, 64, 48
    plan, xs, w, ref = _small_moe_cell(device, 13, e, k, n, t=40)
    tuned = GroupedConfig(16, 16, 32, num_stages=3, tma=True, mix=2)
    monkeypatch.setattr(probe, "choose_config", lambda *a: (tuned, "test"))
    cs = probe.contenders(xs, plan, w, e, n, k)
    assert [c.name for c in cs] == ["tuned", "order:expert", "order:mix4", "even:ours"]
    assert [c.config["mix"] for c in cs] == [2, 0, 4, 2]
    assert all(0 < c.fields["model_us"] < float("inf") for c in cs)
    for c in cs:
        out = c.bind((xs, w))()
        ok, rel, why = c.check(out) if c.check else check(out, ref, k)
        assert ok, (c.name, why)
    monkeypatch.setattr(probe, "choose_config", lambda *a: (GroupedConfig(), "test"))
    assert [c.name for c in probe.contenders(xs, plan, w, e, n, k)] == ["tuned", "even:ours"]


def test_middle_tiles_probe_contenders_compute_their_products(device, monkeypatch):
    """The middle-regime tile probe: the tuned config first, then every new tile config on both grids (the
    names say which), each computing the grouped product (checked against float64 on fresh data, 40 rows
    of 3 experts at a K of 512 so that K steps of 256 loop); a cell with no tuned-table entry is refused."""
    from experiments import probe_middle_tiles as probe
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    e, k, n = 3, 512, 80
    plan, xs, w, ref = _small_moe_cell(device, 17, e, k, n, t=20)
    tuned = GroupedConfig(16, 16, 32, num_stages=3, tma=True)
    monkeypatch.setattr(probe, "choose_config", lambda *a: (tuned, "tuned"))
    cs = probe.contenders(xs, plan, ref, w, 20, e, k, n, {}, ("m", "up", 20, "uniform"))
    assert cs[0].name == "tuned" and cs[0].config == dataclasses.asdict(tuned)
    assert len(cs) == 1 + 2 * len(probe.NEW)
    assert sum(c.config["persistent"] for c in cs) == len(probe.NEW)
    for c in cs:
        out = c.bind((xs, w))()
        ok, rel, why = check(out, ref, k)
        assert ok, (c.name, why)
    monkeypatch.setattr(probe, "choose_config", lambda *a: (tuned, "default"))
    with pytest.raises(RuntimeError, match="tuned-table entry"):
        probe.contenders(xs, plan, ref, w, 20, e, k, n, {}, ("m", "up", 20, "uniform"))


def _small_ffn_cell(device, monkeypatch, seed: int):
    """(E, tokens, expert ids, gating weights, gate/up and down weights, all on ``device``, and the float64
    reference of the layer) of a small random FFN cell: 9 tokens of top-2 over 5 experts, with the grouped
    GEMM's config tables replaced by one small config."""
    import torch

    import moegemm.grouped.config as api
    from moegemm.grouped import GroupedConfig

    from test_grouped import _ffn_ref

    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
    g = torch.Generator().manual_seed(seed)
    e, t, top_k, h, i = 5, 9, 2, 32, 16
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    wts = torch.rand(t, top_k, generator=g)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / 6).to(torch.bfloat16)
    w_dn = (torch.randn(e, h, i, generator=g) / 4).to(torch.bfloat16)
    ref = _ffn_ref(x, ids, wts, w_gu, w_dn)
    return (e, *[v.to(device) for v in (x, ids, wts, w_gu, w_dn)], ref)


def test_decode_routing_probe_contenders_compute_the_layer(device, monkeypatch):
    """The decode-routing probe: the library's layer and both three-launch compositions (the plan at the
    step's blocks and at 128 slots) give moe_ffn's result on fresh data (a float64 reference, 9 tokens of
    top-2 over 5 experts); its cells are the zoo's token counts whose slots fit one chunk."""
    import torch

    import experiments.probe_decode_routing as probe

    e, x, ids, wts, w_gu, w_dn, ref = _small_ffn_cell(device, monkeypatch, 21)
    cs = probe.contenders(x, ids, wts, e)
    assert [c.name for c in cs] == ["ours:moe_ffn", "three-launch", "three-launch, 128-slot plan"]
    for c in cs:
        got = c.bind((w_gu, w_dn))()
        torch.testing.assert_close(got.double().cpu(), ref, rtol=4e-2, atol=4e-2)
    cells = probe._cells()
    assert ("deepseek-v3", 1) in cells and ("deepseek-v3", 16) in cells
    assert ("deepseek-v3", 64) not in cells and ("llama-4-scout", 64) in cells


def test_graph_clock_probe_takes_three_clocks_per_contender(monkeypatch):
    """probe_graph_clock.three_clocks (timers faked on the CPU): each graph-timed contender that passes its
    float64 check gets the host-timed count's graph and graph_timer's, all three clocks in every round, and
    a row with both counts and the three medians; a wrong one is recorded, not timed; one not graph-timed
    is left out."""
    import torch

    import experiments.probe_graph_clock as probe
    from moegemm.bench.runner import Contender, Settings

    class FakeTimer:
        def __init__(self, calls, n):
            self.calls, self.n = calls, n

        def sample(self, replays, hold_cycles=1):
            if not hold_cycles:  # unheld, as the harness timed before
                log.append(self.n)
                return [1.0 * self.n] * replays
            return [100.0 * self.n] * replays

    log = []
    monkeypatch.setattr(probe, "GraphTimer", FakeTimer)
    monkeypatch.setattr(probe, "host_timed_calls", lambda calls, settings: 2)
    monkeypatch.setattr(probe, "graph_timer", lambda calls, settings: FakeTimer(calls, 10))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ref = torch.randn(6, 4, dtype=torch.float64)
    right = ref.to(torch.float32)
    cs = [Contender("a", lambda inp: (lambda: right)), Contender("wrong", lambda inp: (lambda: right + 1.0)),
          Contender("b", lambda inp: (lambda: right.clone())), Contender("loop", lambda inp: (lambda: right), graph=False)]
    rows = probe.three_clocks(cs, [(None,)], ref, 16, Settings(graph_replays=3))
    by = {r["contender"]: r for r in rows}
    assert set(by) == {"a", "wrong", "b"} and by["wrong"]["status"] != "ok" and "graph_us_now" not in by["wrong"]
    for name in ("a", "b"):
        assert by[name]["status"] == "ok"
        assert (by[name]["calls_before"], by[name]["calls_now"], by[name]["rounds"]) == (2, 10, probe.ROUNDS)
        assert (by[name]["graph_us_before"], by[name]["graph_us_count"], by[name]["graph_us_now"]) == (2.0, 10.0, 1000.0)
    assert log == [2, 10] * (2 * probe.ROUNDS)


def test_large_cells_probe_contenders_compute_the_layer(device, monkeypatch):
    """The large-cells probe: its four contenders, in order; moe_ffn and the unfused composition give the
    layer's result on fresh data (a float64 reference, 9 tokens of top-2 over 5 experts; the transformers
    backend's two are E8's own, tested with it); its cells are two models at T=4096, then 16384."""
    import torch

    import experiments.probe_large_cells as probe

    e, x, ids, wts, w_gu, w_dn, ref = _small_ffn_cell(device, monkeypatch, 23)
    cs = probe.contenders(x, ids, wts, e)
    assert [c.name for c in cs] == ["ours:moe_ffn", "ours:unfused-swiglu", "ours:hf-backend",
                                    "ours:hf-backend:compiled"]
    for c in cs[:2]:
        got = c.bind((w_gu, w_dn))()
        torch.testing.assert_close(got.double().cpu(), ref, rtol=4e-2, atol=4e-2)
    assert probe.CELLS == [(m, t) for m in probe.MODELS for t in (4096, 16384)]


def test_replay_log_probe_times_the_host_in_each_replay():
    """probe_compiled_samples' graph wrapper: replay() runs the graph's own replay once per call and keeps the
    host's time in it (a fake graph that sleeps 20 ms here), so GraphTimer.sample times it unchanged."""
    import time

    from experiments.probe_compiled_samples import _TimedReplay

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1
            time.sleep(0.02)

    timed = _TimedReplay(Graph())
    assert timed.host_ms == 0.0
    timed.replay()
    assert Graph.replays == 1 and 19 <= timed.host_ms < 1000


def test_robust_tuning_probe_picks_the_two_choices_and_checks_them(tmp_path, device):
    """The robust-tuning probe: from a tuner CSV (synthetic rows made here) it takes the cells tuned on
    both loads where the config kept differs from the uniform load's fastest (not the others, nor T=1),
    three E7 loads per cell, and its two contenders compute the grouped product (checked against float64)."""
    import dataclasses

    import pandas as pd

    from experiments import probe_robust_tuning as probe
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    a, b = GroupedConfig(16, 16, 32), GroupedConfig(32, 16, 16, persistent=True)
    rows = []
    for t, times in ((64, {a: (100, 300), b: (110, 120)}), (256, {a: (100, 100), b: (120, 90)})):
        for cfg, (uni, zipf) in times.items():
            for load, us in (("uniform", uni), ("zipf1.2", zipf)):
                rows.append({"model": "m", "proj": "up", "tokens": t, "load": load, "status": "ok",
                             "config": repr(dataclasses.asdict(cfg)), "graph_us": float(us)})
    rows.append({"model": "m", "proj": "up", "tokens": 1, "load": "uniform", "status": "ok",
                 "config": repr(dataclasses.asdict(a)), "graph_us": 5.0})
    pd.DataFrame(rows).to_csv(tmp_path / "t.csv", index=False)
    picks = probe.choices(tmp_path / "t.csv")
    assert picks == {("m", "up", 64): (dataclasses.asdict(b), dataclasses.asdict(a))}
    assert probe.cells_of(picks) == [("m", "up", 64, ld) for ld in probe.LOADS]
    e, k, n = 4, 64, 48
    plan, xs, w, ref = _small_moe_cell(device, 13, e, k, n, t=9)
    cs = probe.contenders(xs, plan, 64, "m", "up", picks)
    assert [c.name for c in cs] == ["tuned:both-loads", "tuned:uniform-only"]
    for c in cs:
        ok, rel, why = check(c.bind((xs, w))(), ref, k)
        assert ok, (c.name, why)


def test_tuner_verdict_tells_an_error_from_wrong_values(device):
    """check_and_time: a candidate that raises (e.g. out of shared memory) is recorded as "error" with the
    exception, one whose values fail the float64 check (NaN too) as "wrong"; neither is timed."""
    import torch

    from experiments.common import check_and_time
    from moegemm.bench.correctness import status_of
    from moegemm.bench.runner import Settings

    ref = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def boom():
        raise RuntimeError("out of resource: shared memory")

    rows = [check_and_time([fn], ref, 16, Settings(calls_per_graph=1))
            for fn in (boom, lambda: (ref + 1).float(), lambda: torch.full((8, 4), float("nan")))]
    assert [r["status"] for r in rows] == ["error", "wrong", "wrong"]
    assert rows[0]["note"].startswith("error: RuntimeError: out of resource")
    assert all("graph_us" not in r for r in rows)
    assert status_of(True, "") == "ok"


def test_e7_memory_ceiling_search_and_contender(device, monkeypatch):
    """E7's memory ceiling: every launch shape checked (all bytes read, all outputs written) and timed, the
    fastest kept (GPU clock faked on the CPU); its contender passes its own check on the cell's rows, and a
    launch shape that fails the check is never chosen."""
    import dataclasses

    import experiments.e7_grouped_skew as e7
    from moegemm.bench import stream
    from moegemm.bench.runner import Settings

    times = iter([30.0, 10.0, 20.0, 40.0, 50.0, 60.0])  # one per launch shape

    class FakeTimer:
        def __init__(self, calls, n):
            self.n = n
            for c in calls:
                c()

        def sample(self, n):
            return [next(times)] * n

    monkeypatch.setattr("moegemm.bench.timing.GraphTimer", FakeTimer)
    plan, xs, w, _ = _small_moe_cell(device, 5, 6, 64, 16, 9)  # 1024 weights per expert: every kind fits
    settings = Settings(calls_per_graph=2)
    choice = e7.stream_search([w, w.clone()], xs, plan, settings)
    assert choice["config"] == stream.CANDIDATES[1] and choice["tried"] == len(stream.CANDIDATES)
    c = e7.stream_contender(choice, w, xs, plan)
    ok, rel, why = c.check(c.bind((xs, w))())
    assert ok, why
    # the fastest launch shape reads one active expert too few: it fails its check and is not timed, so the
    # fastest right one is chosen
    real_setup = stream.stream_setup

    def setup(w_, sizes, rows, config):
        s = real_setup(w_, sizes, rows, config)
        return dataclasses.replace(s, active=s.active - 1) if config == stream.CANDIDATES[1] else s

    monkeypatch.setattr(e7, "stream_setup", setup)
    times = iter([30.0, 20.0, 40.0, 50.0, 60.0])
    assert e7.stream_search([w, w.clone()], xs, plan, settings)["config"] == stream.CANDIDATES[2]
    # weights the tma kind cannot stream: only the flat launch shapes are tried
    plan, xs, w, _ = _small_moe_cell(device, 5, 6, 40, 24, 9)  # 960 weights per expert
    monkeypatch.setattr(e7, "stream_setup", real_setup)
    times = iter([30.0, 20.0])
    tried = e7.stream_search([w, w.clone()], xs, plan, settings)["tried"]
    assert tried == sum(c.kind == "flat" for c in stream.CANDIDATES)


def test_prefill_counters_probe_cases_compute_their_products(device, monkeypatch):
    """The counters probe's cases compute what they claim (the tuned tiles, tails of their own and merged
    into the row tile before them, the even deal of the rows, and the two dense GEMMs with expert 0's
    weights), each passing its sampled check on fresh data; a tails case equal to the tuned config is left
    out; the sampled check fails a wrong sampled row and a NaN outside the sample."""
    import torch

    from experiments import probe_prefill_counters as probe
    from moegemm import grouped
    from moegemm.grouped import GroupedConfig

    e, k, n = 4, 64, 48
    plan, xs, w, ref = _small_moe_cell(device, 12, e, k, n, t=9)
    m = xs.shape[0]
    monkeypatch.setattr(probe, "SAMPLE_ROWS", 7)
    tuned = GroupedConfig(64, 16, 32, num_stages=3, tma=True)
    monkeypatch.setattr(grouped, "choose_config", lambda *a: (tuned, "test"))
    from experiments.probe_prefill_tiles import even_offsets

    even = even_offsets(m, e, xs.device)
    assert even.tolist() == [0, 4, 8, 12, 18]
    expect = {"tuned": ref, "tails:separate": ref, "tails:merged": ref,
              "even": __import__("experiments.e7_grouped_skew", fromlist=["ref_rows"]).ref_rows(xs, w, even),
              "dense:ours": xs.double() @ w[0].double().T, "dense:cublas": xs.double() @ w[0].double().T}
    for name, want in expect.items():
        bind, config, offsets = probe.case_calls(name, xs, w, plan, e, n)
        out = bind((xs, w))()
        assert probe.sampled_check(xs, w, offsets, k)(out)[0], name
        assert torch.allclose(out.double(), want, rtol=2e-2, atol=2e-2), name
    assert probe.case_calls("tails:merged", xs, w, plan, e, n)[1]["merge_tail"] is True
    tailed = GroupedConfig(64, 16, 32, num_stages=3, tma=True, tail_m=32)
    monkeypatch.setattr(grouped, "choose_config", lambda *a: (tailed, "test"))
    assert probe.case_calls("tails:separate", xs, w, plan, e, n) is None
    with pytest.raises(ValueError, match="case"):
        probe.case_calls("nonsense", xs, w, plan, e, n)

    good = ref.to(torch.bfloat16)
    chk = probe.sampled_check(xs, w, plan.group_offsets, k)
    assert chk(good)[0]
    gen = torch.Generator(device="cpu").manual_seed(0)  # the sample sampled_check draws
    rows = torch.randperm(m, generator=gen)[:7].sort().values
    bad = good.clone()
    bad[rows[3]] += 1.0
    assert not chk(bad)[0]
    outside = [r for r in range(m) if r not in rows.tolist()][0]
    nan = good.clone()
    nan[outside, 0] = float("nan")
    ok, _, why = chk(nan)
    assert not ok and "non-finite" in why


def test_prefill_counters_probe_reads_ncu_raw_pages():
    """ncu's raw CSV page: the header and units rows, one row per kernel; kept numeric counters become long
    rows (thousands separators removed), strings and counters outside KEPT are dropped, ncu's own ==PROF==
    lines ignored; a text with no header is refused. Metric names come from --query-metrics lines, and only
    the named counters this ncu knows are asked for."""
    from experiments import probe_prefill_counters as probe

    text = "\n".join([
        "==PROF== Connected to process 1",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","gpu__time_duration.sum","lts__t_bytes.sum","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed","device__attribute_display_name","zz__other.sum"',
        '"","","","","","","","","","","","nsecond","byte","%","",""',
        '"0","7","python3","h","_grouped_mm_tma_kernel","1","7","(256, 1, 1)","(6144, 1, 1)","0","9.0","4,963,000","31,234,567,890","71.5","NVIDIA H200","3"',
        '"1","7","python3","h","sm90_xmma_gemm","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","2,792,000","n/a","80.25","NVIDIA H200","4"',
    ])
    rows = probe.parse_raw_csv(text)
    got = {(r["kernel_id"], r["metric"]): (r["unit"], r["value"]) for r in rows}
    assert got == {
        (0, "gpu__time_duration.sum"): ("nsecond", 4963000.0),
        (0, "lts__t_bytes.sum"): ("byte", 31234567890.0),
        (0, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"): ("%", 71.5),
        (1, "gpu__time_duration.sum"): ("nsecond", 2792000.0),
        (1, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"): ("%", 80.25),
    }
    assert {r["kernel"] for r in rows} == {"_grouped_mm_tma_kernel", "sm90_xmma_gemm"}
    assert rows[0]["grid"] == "(6144, 1, 1)"
    with pytest.raises(ValueError, match="ID"):
        probe.parse_raw_csv("==PROF== nothing profiled\n")

    listing = ("Device gh100 (GH100)\n------\nMetric Name   Metric Type   Metric Unit   Metric Description\n"
               "lts__t_bytes   Counter   byte   # of bytes requested\n"
               "dram__bytes_read   Counter   byte   # of bytes read from DRAM\n")
    names = probe.metric_names(listing)
    assert names == {"lts__t_bytes", "dram__bytes_read"}
    assert probe.wanted_metrics(names) == ["lts__t_bytes.sum", "lts__t_bytes.sum.per_second", "dram__bytes_read.sum"]
    assert probe.kept("smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio")
    assert not probe.kept("smsp__average_warps_issue_stalled_gmma") and not probe.kept("lts__t_bytes.min")


def test_prefill_counters_probe_summarises_the_clock_log():
    """The clock summary covers only the samples inside the window and ORs the clock-event reasons."""
    from experiments import probe_prefill_counters as probe

    log = probe.ClockLog.__new__(probe.ClockLog)
    log.samples = [(t, {"sm_mhz": mhz, "mem_mhz": 3201.0, "power_w": p, "temp_c": c, "reasons": r})
                   for t, mhz, p, c, r in [(1.0, 1980.0, 500.0, 50.0, 0), (2.0, 1755.0, 700.0, 60.0, 0x4),
                                           (3.0, 1830.0, 690.0, 61.0, 0x1), (9.0, 900.0, 100.0, 40.0, 0x80)]]
    s = log.summary(1.5, 3.5)
    assert s == {"clock_samples": 2, "sm_mhz_min": 1755.0, "sm_mhz_median": 1830.0, "sm_mhz_max": 1830.0,
                 "power_w_max": 700.0, "temp_c_max": 61.0, "clock_event_reasons": "0x5"}
    assert log.summary(4.0, 5.0) == {"clock_samples": 0}


def test_e7_heldout_contenders_compute_their_products(device, monkeypatch, tmp_path):
    """E7's held-out cell: the default path (no config; records its first call's wall time, the config it
    kept and where it came from: on a GPU it times the shortlist, under the interpreter it does not), the
    distilled shortlist's first config, and torch._grouped_mm, each right against float64 on fresh data; no
    tuned entry covers the shape."""
    import experiments.e7_grouped_skew as e7
    import moegemm.grouped.config as api
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    from moegemm.grouped import autotune

    first = GroupedConfig(16, 16, 32)
    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    monkeypatch.setattr(autotune, "_LOADED", set())
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((first, GroupedConfig(32, 32, 32)),) * 4)
    e, k, n = 5, 64, 40
    plan, xs, w, ref = _small_moe_cell(device, 23, e, k, n, t=7)
    cs = e7.heldout_contenders(xs, plan, e, n)
    assert [c.name for c in cs] == ["ours:auto", "ours:default", "torch._grouped_mm"]
    for c in cs:
        ok, rel, why = check(c.bind((xs, w))(), ref, k)
        assert ok, (c.name, why)
    auto = cs[0]
    timed = xs.is_cuda
    assert auto.fields["first_call_s"] > 0
    assert auto.fields["config_source"] == ("autotuned on this call" if timed else "default")
    kept = [__import__("dataclasses").asdict(c) for c in (first, GroupedConfig(32, 32, 32))]
    assert auto.config in (kept if timed else kept[:1]) and cs[1].config == kept[0]
    ok, _, why = check(auto.bind((xs, w))(), ref, k)  # later calls: no first-call bookkeeping
    assert ok, why


def test_e8_contenders_compute_the_expert_ffn(device, monkeypatch, tmp_path):
    """E8's contenders (ours, ours through transformers' interface, transformers' grouped_mm backend, the
    torch._grouped_mm pipeline, transformers' eager loop) each compute the whole expert FFN, against E8's
    float64 reference on fresh random data (a small zoo-like layer, 6 experts of which some get no token)."""
    import torch

    pytest.importorskip("transformers.integrations.moe")
    import experiments.e8_moe_layer as e8
    import moegemm.grouped.config as api
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    monkeypatch.setenv("MOEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
    monkeypatch.setattr(api, "_default_table", lambda slug: ((GroupedConfig(16, 16, 32),),) * 4)
    e, top_k, t, h, i = 6, 2, 5, 64, 32
    w_gu, w_dn = e8.ffn_weights(3, e, h, i, device=device)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:top_k] for _ in range(t)]).to(device)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    wts = torch.softmax(torch.randn(t, top_k, generator=g), -1).to(device)
    ref = e8.ref_ffn(x, ids, wts, w_gu, w_dn)
    assert e8.layer_sizes({"up": [h, 2 * i], "down": [i, h]}) == (h, i)
    cs = e8.contenders(x, ids, wts, e, h, i, t, compiled=False, vk=None)
    assert [c.name for c in cs] == ["ours:moe_ffn", "ours:unfused-swiglu", "ours:hf-backend", "hf:grouped_mm",
                                    "torch._grouped_mm pipeline", "per-expert-loop"]
    for c in cs:
        ok, rel, why = check(c.bind((w_gu, w_dn))(), ref, h + i)
        assert ok, (c.name, why)


def test_round_orders_rotate_or_balance_the_contenders():
    """"rotate" starts each round one place further down the list (the harness's order before "balanced");
    "balanced" takes each rotation forwards and then backwards, so that over every pair of rounds each
    contender's mean place is the same and it follows both its neighbours; an unknown order is refused."""
    from moegemm.bench.runner import Settings, round_order

    items = list("ABCDE")
    assert [round_order(items, r) for r in range(2)] == [list("ABCDE"), list("BCDEA")]
    assert round_order(items, 5) == items
    pairs = [round_order(items, r, "balanced") for r in range(4)]
    assert pairs == [list("ABCDE"), list("EDCBA"), list("BCDEA"), list("AEDCB")]
    for j in (0, 2):  # each pair: the same mean place for every contender
        means = {c: pairs[j].index(c) + pairs[j + 1].index(c) for c in items}
        assert set(means.values()) == {len(items) - 1}
    before = {r: round_order(items, r, "balanced")[round_order(items, r, "balanced").index("C") - 1]
              for r in (0, 1)}
    assert before == {0: "B", 1: "D"}
    with pytest.raises(ValueError, match="settings.order"):
        Settings(order="random")
    with pytest.raises(ValueError, match="order"):
        round_order(items, 0, "shuffled")


def test_compiled_order_probe_arranges_its_variants():
    """probe_compiled_order: the compiled backend moved to right after the eager one, every other contender
    kept in place; the variants' orders and rounds as its docstring lists them."""
    from experiments.probe_compiled_order import COMPILED, EAGER, after_eager, variants
    from moegemm.bench.runner import Contender, Settings

    names = ["ours:moe_ffn", EAGER, "hf:grouped_mm", "torch._grouped_mm pipeline", COMPILED, "per-expert-loop"]
    cs = [Contender(n, None) for n in names]
    assert [c.name for c in after_eager(cs)] == ["ours:moe_ffn", EAGER, COMPILED, "hf:grouped_mm",
                                                 "torch._grouped_mm pipeline", "per-expert-loop"]
    assert [c.name for c in after_eager(cs[:1])] == ["ours:moe_ffn"]
    got = [(n, s.order, s.rounds) for n, s, _ in variants(Settings(rounds=2))]
    assert got == [("rotate", "rotate", 2), ("balanced", "balanced", 2), ("after-eager", "rotate", 2),
                   ("balanced-4", "balanced", 4), ("rotate-again", "rotate", 2)]


def test_ceiling_probes_take_held_out_cells_and_compute_their_products(device):
    """probe_heldout_ceilings and probe_ffn_ceiling measure held-out models only; dense:ffn runs the FFN's two
    GEMMs with one expert's weights, a different expert each call, and its check passes its first call's
    product and fails another expert's."""
    import torch

    from experiments.common import load_config
    from experiments.probe_ffn_ceiling import cells as ffn_cells
    from experiments.probe_ffn_ceiling import dense_ffn
    from experiments.probe_heldout_ceilings import cells as gemm_cells

    g = load_config()["grouped"]
    held = {m for m, spec in g["models"].items() if spec["split"] == "heldout"}
    assert held and {c[0] for c in gemm_cells(g)} == held == {c[0] for c in ffn_cells(g, ["uniform"])}
    assert {c[3] for c in gemm_cells(g)} == {"uniform"} and {c[2] for c in gemm_cells(g)} == {256, 4096}
    e, rows, h, i = 3, 24, 32, 16
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(rows, h, generator=gen).to(torch.bfloat16).to(device)
    act = torch.randn(rows, i, generator=gen).to(torch.bfloat16).to(device)
    gu = torch.randn(e, 2 * i, h, generator=gen).to(torch.bfloat16).to(device)
    dn = torch.randn(e, h, i, generator=gen).to(torch.bfloat16).to(device)
    c = dense_ffn(xs, act, e, dn[0])
    call = c.bind((gu, dn))
    first, second = call(), call()
    assert c.check(first)[0]
    assert not c.check(second)[0]  # expert 1's product
    torch.testing.assert_close(second.double(), act.double() @ dn[1].double().T, rtol=2e-2, atol=2e-2)


def test_measure_times_the_contenders_in_the_settings_order(monkeypatch):
    """runner.measure takes each round's order from Settings.order: the launch clock's samples (faked here,
    so no GPU is needed) come in rotated rounds by default and in balanced pairs with order="balanced"."""
    import torch

    from moegemm.bench import runner

    seen: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def fake_launch(fn, rep_ms, warmup_ms):
        fn()
        return [1.0]
    monkeypatch.setattr(runner, "launch_samples", fake_launch)

    def contender(name):
        def bind(inp):
            return lambda: seen.append(name) or torch.zeros(1)
        return runner.Contender(name, bind, graph=False, check=lambda out: (True, 0.0, ""))

    for order, want in (("rotate", "ABC" "BCA" "CAB" "ABC"), ("balanced", "ABC" "CBA" "BCA" "ACB")):
        seen.clear()
        rows = runner.measure([contender(c) for c in "ABC"], [()], torch.zeros(1), 1,
                              runner.Settings(rounds=4, order=order))
        assert "".join(seen[3:]) == want  # after the three checking calls
        assert [r["launch_n"] for r in rows] == [4, 4, 4]


def test_gluon_probe_takes_tune_prefill_cells_and_refuses_bad_inputs():
    """probe_gluon_prefill measures the tune models' prefill cells only (both projections and loads), and the
    Gluon kernel's launcher refuses what it cannot serve, naming the argument, before any launch."""
    import torch

    from experiments.common import load_config
    from experiments.gluon_grouped import ws_grouped_mm
    from experiments.probe_gluon_prefill import cells

    g = load_config()["grouped"]
    got = cells(g)
    assert {c[0] for c in got} == {m for m, s in g["models"].items() if s["split"] == "tune"}
    assert {c[2] for c in got} == set(g["prefill_tokens"]) and {c[1] for c in got} == {"up", "down"}
    assert len(got) == len({c[0] for c in got}) * 2 * len(g["prefill_tokens"]) * 2
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    for args, kw, match in (((x.float(), w.float(), off), {}, "16-bit"), ((x, w[:, :, :48], off), {}, "K"),
                            ((x, w, off.long()), {}, "offsets"), ((x, w, off[:2]), {}, "offsets"),
                            ((x, w, off), {"block_n": 96}, "block_n"), ((x, w, off), {"block_n": 256, "pingpong": True}, "block_n"),
                            ((x.t(), w, off), {}, "contiguous")):
        with pytest.raises(ValueError, match=match):
            ws_grouped_mm(*args, **kw)
    with pytest.raises(RuntimeError, match="CUDA"):
        ws_grouped_mm(x, w, off)


@pytest.mark.long
def test_gluon_kernel_compiles_for_sm90_with_split_warps():
    """The Gluon kernel compiles for sm_90 with the installed Triton in every config the probe measures (few
    and many experts, bf16 and fp16), within Hopper's 227 KB of shared memory per block, with its warps
    split by register count (setmaxnreg) and its products on the asynchronous warp-group MMA."""
    import os
    import subprocess
    import sys

    from experiments.common import ROOT
    from experiments.gluon_grouped import VARIANTS

    code = ("import torch\n"
            "from experiments.gluon_grouped import VARIANTS, compile_sm90\n"
            "for name, bn, st, pp in VARIANTS:\n"
            "    for e, dt in ((8, torch.bfloat16), (256, torch.bfloat16), (16, torch.float16)):\n"
            "        k = compile_sm90(e, bn, st, pp, dt)\n"
            "        ptx = k.asm['ptx']\n"
            "        print('compiled', name, e, k.metadata.shared, 'setmaxnreg' in ptx, 'wgmma.mma_async' in ptx)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         cwd=str(ROOT))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("compiled")]
    assert len(lines) == 3 * len(VARIANTS) >= 12
    for _, name, e, shared, split, mma in lines:
        assert 0 < int(shared) <= 232448 and split == "True" and mma == "True", (name, e, shared)


def test_gluon_probe_contenders_compute_their_products(device, monkeypatch):
    """probe_gluon_prefill's contenders: ours on both grids with the chosen config, each Gluon config (its
    kernel replaced here by a float64 product, since Gluon has no interpreter; the poisoned output it is
    handed must be the one returned) and torch._grouped_mm, each computing the grouped product against
    float64 on fresh data; the summary compares the best of ours with the best Gluon config."""
    import torch

    from experiments import e7_grouped_skew as e7
    from experiments import probe_gluon_prefill as probe
    from experiments.gluon_grouped import VARIANTS
    from moegemm.bench.correctness import check
    from moegemm.grouped import GroupedConfig

    e, k, n = 3, 128, 80
    plan, xs, w, ref = _small_moe_cell(device, 23, e, k, n, t=20)
    handed = []

    def fake(x, w_, offsets, y, block_n, stages, pingpong):
        assert bool(torch.isnan(y).all())  # poisoned before the first call
        handed.append((block_n, stages, pingpong))
        off = offsets.tolist()
        for i in range(w_.shape[0]):
            y[off[i]:off[i + 1]] = (x[off[i]:off[i + 1]].double() @ w_[i].double().T).to(y.dtype)
        return y
    monkeypatch.setattr(probe, "ws_grouped_mm", fake)
    monkeypatch.setattr(e7, "choose_config", lambda *a: (GroupedConfig(16, 16, 32), "tuned"))
    cs = probe.contenders_of(xs, plan, ref, w, 20, e, k, n, {}, ("m", "up", 20, "uniform"))
    assert [c.name for c in cs] == (["ours:contiguous", "ours:persistent"] + [f"gluon-ws:{v[0]}" for v in VARIANTS]
                                    + ["torch._grouped_mm"])
    for c in cs:
        ok, rel, why = check(c.bind((xs, w))(), ref, k)
        assert ok, (c.name, why)
    assert handed == [v[1:] for v in VARIANTS]
    rows = [{"contender": c.name, "status": "ok", "graph_us": us} for c, us in zip(cs, (10, 9, 12, 6, 8, 7, 20))]
    assert probe.summary(rows).endswith("ours/gluon 1.500")


def test_e8_annotate_gives_ffn_rows_their_cell_columns():
    """e8_moe_layer.annotate (E8's rows and probe_ffn_ceiling's): the cell's columns, the floor, bytes and
    FLOPs of the FFN's two GEMMs (gate/up [H, 2I], down [I, H]) together, and each timed row's rates."""
    import math

    from experiments.e7_grouped_skew import floor_us
    from experiments.e8_moe_layer import annotate

    m = {"split": "heldout", "experts": 8, "top_k": 2}
    rows = [{"contender": "a", "graph_us": 100.0}, {"contender": "b"}]
    annotate(rows, "E8", m, "mx", 16, "uniform", 64, 32, 5, 3, "nvidia-h200", {"gpu": "g"})
    up, dn = floor_us(32, 64, 64, 5, "nvidia-h200"), floor_us(32, 32, 64, 5, "nvidia-h200")
    assert rows[0]["floor_us"] == up[0] + dn[0] and rows[0]["bytes"] == up[1] + dn[1]
    assert rows[0]["flops"] == up[2] + dn[2] == 2 * 32 * (64 * 64 + 32 * 64)
    assert rows[0]["tflops_graph"] == rows[0]["flops"] / 100.0 / 1e6 and math.isnan(rows[1]["tflops_graph"])
    assert {k: rows[1][k] for k in ("experiment", "model", "split", "tokens", "experts", "top_k", "input_sets", "gpu")} \
        == {"experiment": "E8", "model": "mx", "split": "heldout", "tokens": 16, "experts": 8, "top_k": 2,
            "input_sets": 3, "gpu": "g"}
