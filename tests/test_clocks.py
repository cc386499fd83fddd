"""The harness's clocks on the CPU (GPU timers faked): quantiles, calls per graph, the order of the
rounds and of the contenders in them."""

from __future__ import annotations

import pytest

from experiments.harness.timing import Clock


def test_clock_quantiles():
    c = Clock.of([float(x) for x in range(1, 11)])
    assert c.median_us == 5.5 and c.samples == 10 and c.p20_us < c.median_us < c.p80_us
    assert Clock.of([]).samples == 0


def test_calls_per_graph_shrink_only_for_long_kernels():
    """Settings.min_graph_us: a kernel of milliseconds gets as few calls per graph as give min_graph_us per
    replay, but never fewer than two or than the input sets it rotates through; short kernels keep
    calls_per_graph; without the setting nothing changes."""
    from experiments.harness.runner import Settings, fewest_calls

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

    from experiments.harness import timing
    from experiments.harness.runner import Settings, graph_timer

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


def test_round_orders_rotate_or_balance_the_contenders():
    """ "rotate" starts each round one place further down the list (the harness's order before "balanced");
    "balanced" takes each rotation forwards and then backwards, so that over every pair of rounds each
    contender's mean place is the same and it follows both its neighbours; an unknown order is refused."""
    from experiments.harness.runner import Settings, round_order

    items = list("ABCDE")
    assert [round_order(items, r) for r in range(2)] == [list("ABCDE"), list("BCDEA")]
    assert round_order(items, 5) == items
    pairs = [round_order(items, r, "balanced") for r in range(4)]
    assert pairs == [list("ABCDE"), list("EDCBA"), list("BCDEA"), list("AEDCB")]
    for j in (0, 2):  # each pair: the same mean place for every contender
        means = {c: pairs[j].index(c) + pairs[j + 1].index(c) for c in items}
        assert set(means.values()) == {len(items) - 1}
    before = {
        r: round_order(items, r, "balanced")[round_order(items, r, "balanced").index("C") - 1] for r in (0, 1)
    }
    assert before == {0: "B", 1: "D"}
    with pytest.raises(ValueError, match="settings.order"):
        Settings(order="random")
    with pytest.raises(ValueError, match="order"):
        round_order(items, 0, "shuffled")


def test_measure_times_the_contenders_in_the_settings_order(monkeypatch):
    """runner.measure takes each round's order from Settings.order: the launch clock's samples (faked here,
    so no GPU is needed) come in rotated rounds by default and in balanced pairs with order="balanced"."""
    import torch

    from experiments.harness import runner

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

    for order, want in (("rotate", "ABCBCACABABC"), ("balanced", "ABCCBABCAACB")):
        seen.clear()
        rows = runner.measure(
            [contender(c) for c in "ABC"], [()], torch.zeros(1), 1, runner.Settings(rounds=4, order=order)
        )
        assert "".join(seen[3:]) == want  # after the three checking calls
        assert [r["launch_n"] for r in rows] == [4, 4, 4]
        # each row's own costs, and the cell's parallel compiles (the same on every row)
        assert all(r["setup_s"] >= 0 and r["timed_s"] >= 0 for r in rows)
        assert len({r["prewarm_s"] for r in rows}) == 1 and rows[0]["prewarm_s"] >= 0


@pytest.mark.parametrize("one_graph", [False, True])
def test_one_graph_holds_one_contender_graph_at_a_time(monkeypatch, one_graph):
    """With Settings.one_graph, measure captures each contender's graph afresh in every round and frees it
    after its samples, so that no two graphs are alive at once (GraphTimer faked on the CPU); without it,
    one graph per contender lives over all rounds. Both give every contender a graph sample per round."""
    import torch

    from experiments.harness import runner, timing

    alive, most = set(), [0]

    class FakeTimer:
        def __init__(self, calls, n):
            self.n = n
            alive.add(id(self))
            most[0] = max(most[0], len(alive))

        def __del__(self):
            alive.discard(id(self))

        def sample(self, replays=5):
            return [2.0] * replays

    monkeypatch.setattr(timing, "GraphTimer", FakeTimer)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(runner, "launch_samples", lambda fn, rep, warm: [1.0])
    cs = [
        runner.Contender(name, lambda inp: lambda: torch.zeros(1), check=lambda out: (True, 0.0, ""))
        for name in "ABC"
    ]
    rows = runner.measure(
        cs, [()], torch.zeros(1), 1, runner.Settings(rounds=3, graph_replays=2, one_graph=one_graph)
    )
    assert most[0] == (1 if one_graph else 3)
    assert [r["graph_n"] for r in rows] == [6, 6, 6]
    assert all(r["graph_round_us"] == "2.0000;2.0000;2.0000" for r in rows)
    assert not alive
