"""The grouped GEMM's tuner (experiments/tune_grouped.py) on the CPU, its GPU timers faked: the screen,
the final round, the choice over loads, the candidates, and its verdict on a failing config."""

from __future__ import annotations

import json

import pytest

from experiments.common import ResultWriter


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

    monkeypatch.setattr("experiments.harness.timing.GraphTimer", FakeTimer)
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
    assert order[-2 * tg.SCREEN_ROUNDS :] == [
        first + (r + j) % 2 for r in range(tg.SCREEN_ROUNDS) for j in range(2)
    ]
    assert all(r["status"] == "ok" and r["graph_us"] >= 100 for r in rows)
    best = sorted(writer.rows + rows, key=lambda r: r["graph_us"])[: tg.PERSISTENT_TRIES - 1]
    more = tg.time_configs(
        [dataclasses.replace(GroupedConfig(**r["config"]), persistent=True) for r in best],
        writer,
        base,
        xs,
        [w],
        plan.group_offsets,
        ref,
    )
    assert [GroupedConfig(**r["config"]).persistent for r in more] == [True, True]


def test_grouped_tuner_screens_a_whole_load_in_one_batch_unless_memory_is_short(
    tmp_path, monkeypatch, device
):
    """Every config of a screen call is timed in one side-by-side batch (nine configs here: more than the
    old batches of eight), its rounds rotating over all of them; screen_batch shrinks the batch to what
    SCREEN_MEMORY of the free memory holds (never below two)."""
    import experiments.tune_grouped as tg
    from experiments.e7_grouped_skew import ref_rows
    from moegemm.grouped import GroupedConfig

    made, order = _fake_graph_timers(monkeypatch, lambda timer, count: 100.0 + timer)
    plan, xs, w = _tuner_cell(device)
    cfgs = [
        GroupedConfig(16, bn, bk, num_stages=st) for bn in (16, 32, 64) for bk in (16, 32) for st in (2, 3)
    ][:9]
    writer = ResultWriter(tmp_path / "t.csv", ("model", "proj", "tokens", "config"))
    rows = tg.time_configs(
        cfgs,
        writer,
        {"model": "m", "proj": "up", "tokens": 12},
        xs,
        [w],
        plan.group_offsets,
        ref_rows(xs, w, plan.group_offsets),
    )
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

    screen = [
        row(64, "uniform", 100.0, "screen"),
        row(64, "zipf1.2", 100.0, "screen"),
        row(128, "uniform", 105.0, "screen"),
        row(128, "zipf1.2", 104.0, "screen"),
    ]
    loads = ("uniform", "zipf1.2")
    assert json.loads(tg.cell_choice(screen, loads)[1])["block_m"] == 64
    final = [
        row(64, "uniform", 110.0, "final"),
        row(64, "zipf1.2", 111.0, "final"),
        row(128, "uniform", 101.0, "final"),
        row(128, "zipf1.2", 102.0, "final"),
    ]
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

    rows = [
        row(16, "uniform", 100.0),
        row(16, "zipf1.2", 200.0),  # geomean 141
        row(64, "uniform", 110.0),
        row(64, "zipf1.2", 120.0),  # geomean 115
        row(32, "uniform", 90.0),
        row(32, "zipf1.2", 1.0, "wrong"),
        row(128, "uniform", 95.0),
    ]
    order = tg.robust_order(rows, ("uniform", "zipf1.2"))
    assert [json.loads(c)["block_m"] for _, c in order] == [64, 16]
    assert abs(order[0][0] - (110.0 * 120.0) ** 0.5) < 1e-9
    assert [json.loads(c)["block_m"] for _, c in tg.robust_order(rows, ("uniform",))] == [32, 128, 16, 64]
    old = [
        {k: v for k, v in r.items() if k != "load"} for r in rows if r["load"] == "uniform"
    ]  # pre-load rows
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
    # past the middle regime, merged tails only as 32-row tails of 128 x 256 tiles, without warp
    # specialization
    assert {
        (c.block_m, c.block_n, c.tail_m, c.flatten)
        for mean in (128, 512)
        for c in candidates(mean)
        if c.merge_tail
    } == {(128, 256, 32, False)}


def test_tuner_verdict_tells_an_error_from_wrong_values(device):
    """check_and_time: a candidate that raises (e.g. out of shared memory) is recorded as "error" with the
    exception, one whose values fail the float64 check (NaN too) as "wrong"; neither is timed."""
    import torch

    from experiments.common import check_and_time
    from experiments.harness.correctness import status_of
    from experiments.harness.runner import Settings

    ref = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def boom():
        raise RuntimeError("out of resource: shared memory")

    rows = [
        check_and_time([fn], ref, 16, Settings(calls_per_graph=1))
        for fn in (boom, lambda: (ref + 1).float(), lambda: torch.full((8, 4), float("nan")))
    ]
    assert [r["status"] for r in rows] == ["error", "wrong", "wrong"]
    assert rows[0]["note"].startswith("error: RuntimeError: out of resource")
    assert all("graph_us" not in r for r in rows)
    assert status_of(True, "") == "ok"
