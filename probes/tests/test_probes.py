"""The probes' CPU-testable parts (probes/probe_*.py): each probe's contenders compute their products on
small random cells (against float64), and its cells, clocks and parsers do what the probe needs."""

from __future__ import annotations

import json

import pytest

from tests.moe_cells import small_moe_cell

pytestmark = pytest.mark.probe  # the probes' own tests (the pipeline runs no probe)


def test_prefill_tiles_probe_contenders_compute_their_products(device, monkeypatch):
    """The prefill probe's contenders: the tuned tiles with tails of their own and merged, on [E, K, N]
    weights, and 128 x 128 x 128 tiles
    compute the grouped product, the two dense yardsticks (cuBLAS, our kernel with one expert) the product
    with expert 0's weights, and the even deal of the rows (9 x 2 rows, 4 per expert and the last expert 6)
    its own grouped product, each checked against float64 on fresh data; a variant gives up a stage where
    its shared memory would not fit, and a pointer-load config has none."""

    from experiments.harness.correctness import check
    from moegemm.grouped import GroupedConfig
    from probes import probe_prefill_tiles as probe

    e, k, n = 4, 64, 48
    plan, xs, w, ref = small_moe_cell(device, 11, e, k, n, t=9)
    dense = xs.double() @ w[0].double().T
    tuned = GroupedConfig(64, 16, 32, num_stages=3, tma=True)
    monkeypatch.setattr(probe, "choose_config", lambda *a: (tuned, "test"))
    cs = probe.contenders(xs, plan, dense, k, e, n, w)
    assert [c.name for c in cs] == [
        "tuned",
        "tuned:separate-tails",
        "tuned:merged-tails",
        "tuned:kn",
        "tile:128x128x128",
        "dense:cublas",
        "dense:ours",
        "even:ours",
    ]
    assert [(c.config["tail_m"], c.config["merge_tail"]) for c in cs if "tails" in c.name] == [
        (32, False),
        (32, True),
    ]
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
    from experiments.harness.correctness import check
    from moegemm.grouped import GroupedConfig
    from probes import probe_mixed_order as probe

    e, k, n = 4, 64, 48
    plan, xs, w, ref = small_moe_cell(device, 13, e, k, n, t=40)
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


def test_prefill_counters_probe_cases_compute_their_products(device, monkeypatch):
    """The counters probe's cases compute what they claim (the tuned tiles, tails of their own and merged
    into the row tile before them, the even deal of the rows, and the two dense GEMMs with expert 0's
    weights), each passing its sampled check on fresh data; a tails case equal to the tuned config is left
    out; the sampled check fails a wrong sampled row and a NaN outside the sample."""
    import torch

    from moegemm import grouped
    from moegemm.grouped import GroupedConfig
    from probes import probe_prefill_counters as probe

    e, k, n = 4, 64, 48
    plan, xs, w, ref = small_moe_cell(device, 12, e, k, n, t=9)
    m = xs.shape[0]
    monkeypatch.setattr(probe, "SAMPLE_ROWS", 7)
    tuned = GroupedConfig(64, 16, 32, num_stages=3, tma=True)
    monkeypatch.setattr(grouped, "choose_config", lambda *a: (tuned, "test"))
    from probes.common import even_offsets

    even = even_offsets(m, e, xs.device)
    assert even.tolist() == [0, 4, 8, 12, 18]
    expect = {
        "tuned": ref,
        "tails:separate": ref,
        "tails:merged": ref,
        "even": __import__("experiments.e7_grouped_skew", fromlist=["ref_rows"]).ref_rows(xs, w, even),
        "dense:ours": xs.double() @ w[0].double().T,
        "dense:cublas": xs.double() @ w[0].double().T,
    }
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


def test_prefill_counters_probe_takes_cells_and_cases_by_name(device):
    """--cells and --cases: zoo cells as MODEL:PROJ:T:LOAD and the probe's cases (the multicast cluster
    kernel's two forms among them) by name, a malformed cell or an unknown case refused naming the option;
    the cluster cases are left out where the kernel cannot run (here: no Hopper GPU), never run as the
    library's kernel under their name."""
    import torch

    from probes import probe_prefill_counters as probe

    assert probe.parse_cells("mixtral-8x7b:up:4096:uniform,dbrx:down:16:zipf1.2") == [
        ("mixtral-8x7b", "up", 4096, "uniform"),
        ("dbrx", "down", 16, "zipf1.2"),
    ]
    for bad in ("mixtral-8x7b:up:4096", "mixtral-8x7b:gate:4096:uniform", "dbrx:up:many:uniform"):
        with pytest.raises(ValueError, match="--cells: expected MODEL:PROJ:T:LOAD"):
            probe.parse_cells(bad)
    assert probe.parse_cases("tuned,mcast:ws") == ("tuned", "mcast:ws")
    assert probe.parse_cases("mcast:async-cta-lag2") == ("mcast:async-cta-lag2",)
    from probes.cluster_grouped_kernel import ClusterGroupedConfig

    assert set(probe.CLUSTER_SETTINGS) == set(probe.CLUSTER_CASES)
    for settings in probe.CLUSTER_SETTINGS.values():  # each a valid config of the probe's tiles
        ClusterGroupedConfig(block_m=128, block_n=256, num_warps=8, stages=4, **settings)
    with pytest.raises(ValueError, match=r"--cases: not cases of this probe: \['mcast:sync'\]"):
        probe.parse_cases("tuned,mcast:sync")
    plan, xs, w, _ = small_moe_cell(device, 12, 4, 64, 48, t=9)
    if device == "cpu":
        for case in probe.CLUSTER_CASES:
            assert probe.case_calls(case, xs, w, plan, 4, 48) is None
        from probes import cluster_grouped as cg

        # where the cluster kernel cannot serve a call, strict refuses it rather than run the library's
        with pytest.raises(RuntimeError, match="cannot serve this call"):
            cg.grouped_mm(xs, w, plan.group_offsets, w_layout="nk", strict=True)
        assert torch.isfinite(cg.grouped_mm(xs, w, plan.group_offsets, w_layout="nk")).all()


def test_prefill_counters_probe_reads_ncu_raw_pages():
    """ncu's raw CSV page: the header and units rows, one row per kernel; kept numeric counters become long
    rows (thousands separators removed), strings and counters outside KEPT are dropped, ncu's own ==PROF==
    lines ignored; a text with no header is refused. Metric names come from --query-metrics lines, and only
    the named counters this ncu knows are asked for."""
    from probes import probe_prefill_counters as probe

    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            (
                '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
                '"Block Size","Grid Size","Device","CC","gpu__time_duration.sum","lts__t_bytes.sum",'
                '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",'
                '"device__attribute_display_name","zz__other.sum"'
            ),
            '"","","","","","","","","","","","nsecond","byte","%","",""',
            (
                '"0","7","python3","h","_grouped_mm_tma_kernel","1","7","(256, 1, 1)","(6144, 1, 1)",'
                '"0","9.0","4,963,000","31,234,567,890","71.5","NVIDIA H200","3"'
            ),
            (
                '"1","7","python3","h","sm90_xmma_gemm","1","7","(384, 1, 1)","(132, 1, 1)",'
                '"0","9.0","2,792,000","n/a","80.25","NVIDIA H200","4"'
            ),
        ]
    )
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

    listing = (
        "Device gh100 (GH100)\n------\nMetric Name   Metric Type   Metric Unit   Metric Description\n"
        "lts__t_bytes   Counter   byte   # of bytes requested\n"
        "dram__bytes_read   Counter   byte   # of bytes read from DRAM\n"
    )
    names = probe.metric_names(listing)
    assert names == {"lts__t_bytes", "dram__bytes_read"}
    assert probe.wanted_metrics(names) == [
        "lts__t_bytes.sum",
        "lts__t_bytes.sum.per_second",
        "dram__bytes_read.sum",
    ]
    assert probe.kept("smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio")
    assert not probe.kept("smsp__average_warps_issue_stalled_gmma") and not probe.kept("lts__t_bytes.min")


def test_prefill_counters_probe_summarises_the_clock_log():
    """The clock summary covers only the samples inside the window and ORs the clock-event reasons."""
    from probes import probe_prefill_counters as probe

    log = probe.ClockLog.__new__(probe.ClockLog)
    log.samples = [
        (t, {"sm_mhz": mhz, "mem_mhz": 3201.0, "power_w": p, "temp_c": c, "reasons": r})
        for t, mhz, p, c, r in [
            (1.0, 1980.0, 500.0, 50.0, 0),
            (2.0, 1755.0, 700.0, 60.0, 0x4),
            (3.0, 1830.0, 690.0, 61.0, 0x1),
            (9.0, 900.0, 100.0, 40.0, 0x80),
        ]
    ]
    s = log.summary(1.5, 3.5)
    assert s == {
        "clock_samples": 2,
        "sm_mhz_min": 1755.0,
        "sm_mhz_median": 1830.0,
        "sm_mhz_max": 1830.0,
        "power_w_max": 700.0,
        "temp_c_max": 61.0,
        "clock_event_reasons": "0x5",
    }
    assert log.summary(4.0, 5.0) == {"clock_samples": 0}


def test_ceiling_probes_take_held_out_cells_and_compute_their_products(device):
    """probe_heldout_ceilings and probe_ffn_ceiling measure held-out models only; dense:ffn runs the FFN's two
    GEMMs with one expert's weights, a different expert each call, and its check passes its first call's
    product and fails another expert's."""
    import torch

    from experiments.common import load_config
    from probes.probe_ffn_ceiling import cells as ffn_cells
    from probes.probe_ffn_ceiling import dense_ffn
    from probes.probe_heldout_ceilings import cells as gemm_cells

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


def test_gluon_probe_takes_tune_prefill_cells_and_refuses_bad_inputs():
    """probe_gluon_prefill measures the tune models' prefill cells only (both projections and loads), and the
    Gluon kernel's launcher refuses what it cannot serve, naming the argument, before any launch."""
    import torch

    from experiments.common import load_config
    from probes.gluon_grouped import ws_grouped_mm
    from probes.probe_gluon_prefill import cells

    g = load_config()["grouped"]
    got = cells(g)
    assert {c[0] for c in got} == {m for m, s in g["models"].items() if s["split"] == "tune"}
    assert {c[2] for c in got} == set(g["prefill_tokens"]) and {c[1] for c in got} == {"up", "down"}
    assert len(got) == len({c[0] for c in got}) * 2 * len(g["prefill_tokens"]) * 2
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    for args, kw, match in (
        ((x.float(), w.float(), off), {}, "16-bit"),
        ((x, w[:, :, :48], off), {}, "K"),
        ((x, w, off.long()), {}, "offsets"),
        ((x, w, off[:2]), {}, "offsets"),
        ((x, w, off), {"block_n": 96}, "block_n"),
        ((x, w, off), {"block_n": 256, "pingpong": True}, "block_n"),
        ((x.t(), w, off), {}, "contiguous"),
    ):
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
    from probes.gluon_grouped import VARIANTS

    code = (
        "import torch\n"
        "from probes.gluon_grouped import VARIANTS, compile_sm90\n"
        "for name, bn, st, pp in VARIANTS:\n"
        "    for e, dt in ((8, torch.bfloat16), (256, torch.bfloat16), (16, torch.float16)):\n"
        "        k = compile_sm90(e, bn, st, pp, dt)\n"
        "        ptx = k.asm['ptx']\n"
        "        print('compiled', name, e, k.metadata.shared, 'setmaxnreg' in ptx, "
        "'wgmma.mma_async' in ptx)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900, cwd=str(ROOT)
    )
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
    from experiments.harness.correctness import check
    from moegemm.grouped import GroupedConfig
    from probes import probe_gluon_prefill as probe
    from probes.gluon_grouped import VARIANTS

    e, k, n = 3, 128, 80
    plan, xs, w, ref = small_moe_cell(device, 23, e, k, n, t=20)
    handed = []

    def fake(x, w_, offsets, y, block_n, stages, pingpong):
        assert bool(torch.isnan(y).all())  # poisoned before the first call
        handed.append((block_n, stages, pingpong))
        off = offsets.tolist()
        for i in range(w_.shape[0]):
            y[off[i] : off[i + 1]] = (x[off[i] : off[i + 1]].double() @ w_[i].double().T).to(y.dtype)
        return y

    monkeypatch.setattr(probe, "ws_grouped_mm", fake)
    monkeypatch.setattr(e7, "choose_config", lambda *a: (GroupedConfig(16, 16, 32), "tuned"))
    cs = probe.contenders_of(xs, plan, ref, w, 20, e, k, n, {}, ("m", "up", 20, "uniform"))
    assert [c.name for c in cs] == (
        ["ours:contiguous", "ours:persistent"]
        + [f"gluon-ws:{v[0]}" for v in VARIANTS]
        + ["torch._grouped_mm"]
    )
    for c in cs:
        ok, rel, why = check(c.bind((xs, w))(), ref, k)
        assert ok, (c.name, why)
    assert handed == [v[1:] for v in VARIANTS]
    rows = [
        {"contender": c.name, "status": "ok", "graph_us": us} for c, us in zip(cs, (10, 9, 12, 6, 8, 7, 20))
    ]
    assert probe.summary(rows).endswith("ours/gluon 1.500")


def test_power_probe_checks_each_contender_then_holds_the_right_ones_in_rotated_rounds(monkeypatch):
    """probe_power.measure_cell: every contender's first call checked (against float64, or its own check);
    a wrong one and one that raises are recorded with their reason and not held; the right ones are held
    ROUNDS times, who goes first rotating from round to round (starting at the cell's turn), and each row
    keeps the medians of its holds, the fastest and slowest hold and the count."""
    import math

    import torch

    from experiments.harness.runner import Contender
    from probes import probe_power as probe

    torch.manual_seed(0)
    k = 16
    ref = torch.randn(8, 4, dtype=torch.float64)
    right = ref.to(torch.float32)

    def returning(t):
        return lambda inp: lambda: t

    def raising(inp):
        def call():
            raise RuntimeError("no kernel image")

        return call

    cs = [
        Contender("a", returning(right), config={"x": 1}),
        Contender("wrong", returning(right + 1.0)),
        Contender("b", returning(right.clone())),
        Contender("broken", raising),
        Contender("own", returning(torch.zeros(3)), check=lambda out: (True, math.nan, "own check")),
    ]
    order = []

    class FakeTimer:
        def __init__(self, calls, n):
            self.n = n

    def fake_hold(timer, seconds, nvml):
        order.append(timer)
        i = len(order)  # the i-th hold of the cell: its time and clock
        return {"graph_us": 10.0 * i, "sm_mhz": 1000 + i, "power_w": 600.0}

    monkeypatch.setattr(probe, "graph_timer", lambda calls, settings: FakeTimer(calls, 4))
    monkeypatch.setattr(probe, "hold", fake_hold)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(probe, "ROUNDS", 3)
    rows = probe.measure_cell(cs, [(None, None)], ref, k, None, nvml=None, turn=1)
    by = {r["contender"]: r for r in rows}
    assert [r["contender"] for r in rows] == ["a", "wrong", "b", "broken", "own"]
    assert by["wrong"]["status"] == "wrong" and "graph_us" not in by["wrong"]
    assert (
        by["broken"]["status"] != "ok"
        and "no kernel image" in by["broken"]["note"]
        and "graph_us" not in by["broken"]
    )
    # the right ones: a, b, own; rounds start at b (turn 1), then own, then a
    assert len(order) == 9
    holds = {"b": [1, 6, 8], "own": [2, 4, 9], "a": [3, 5, 7]}  # positions of each contender's holds
    for c, pos in holds.items():
        assert by[c]["graph_us"] == 10.0 * sorted(pos)[1] and by[c]["sm_mhz"] == 1000 + sorted(pos)[1]
        assert by[c]["graph_us_min"] == 10.0 * pos[0] and by[c]["graph_us_max"] == 10.0 * pos[-1]
        assert by[c]["holds"] == 3 and by[c]["graph_calls"] == 4 and by[c]["status"] == "ok"
    assert json.loads(by["a"]["config"]) == {"x": 1} and by["own"]["note"] == "own check"


def test_first_call_probe_runs_each_measurement_in_a_fresh_process(monkeypatch):
    """probe_first_call: each measurement is a new process with empty Triton and autotune caches (new folders
    each time), the compile threads set for one setting and left to the library's default for the other
    (an inherited value removed), and a child that fails is recorded with its last error line, one that
    outlasts the timeout as such; its --cells parser refuses items that are not model:T."""
    import subprocess
    import types

    from probes import probe_first_call as probe

    seen = []

    def fake_run(cmd, env, capture_output, text, timeout):
        seen.append((cmd, env))
        if env["TRITON_CACHE_DIR"] == "fail":
            return types.SimpleNamespace(returncode=1, stdout="", stderr="Traceback\nRuntimeError: boom\n")
        return types.SimpleNamespace(returncode=0, stdout='{"first_call_s": 1.5, "threads": 8}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("MOEGEMM_COMPILE_THREADS", "5")
    row = probe.run_child("dbrx", 4096, None, 10)
    assert row == {"status": "ok", "process_s": row["process_s"], "first_call_s": 1.5, "threads": 8}
    probe.run_child("dbrx", 4096, "1", 10)
    (cmd0, env0), (_, env1) = seen
    assert cmd0[-2:] == ["--child", "dbrx:4096"]
    assert "MOEGEMM_COMPILE_THREADS" not in env0 and env1["MOEGEMM_COMPILE_THREADS"] == "1"
    assert env0["TRITON_CACHE_DIR"] != env1["TRITON_CACHE_DIR"]
    assert env0["MOEGEMM_CACHE_DIR"] not in (env0["TRITON_CACHE_DIR"], env1["MOEGEMM_CACHE_DIR"])
    monkeypatch.setattr(probe.tempfile, "TemporaryDirectory", lambda: _named("fail"))
    assert probe.run_child("dbrx", 16, "1", 10) == {"status": "error", "note": "RuntimeError: boom"}

    def too_slow(cmd, env, capture_output, text, timeout):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", too_slow)
    assert probe.run_child("dbrx", 16, "1", 10) == {"status": "error", "note": "no result within 10 s"}
    assert probe.parse_cells("dbrx:4096,olmoe-1b-7b:16") == [("dbrx", 4096), ("olmoe-1b-7b", 16)]
    for bad in ("dbrx", "dbrx:x", ":16"):
        with pytest.raises(SystemExit, match="--cells"):
            probe.parse_cells(bad)


class _named:
    """A stand-in for tempfile.TemporaryDirectory that yields a fixed name."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        return self.name

    def __exit__(self, *exc):
        return False


def test_dk_latency_ceiling_kernel_stores_a_split_partial_or_nothing(device):
    """probe_dk_latency's ceiling kernel (the library's partial_tile per program): with LOAD each split's fp32
    partial of its K slice lands in C (one split: the whole product, against float64; two: the one stored
    last, either slice's); without LOAD it writes nothing."""
    import torch
    import triton

    from probes.probe_dk_latency import _ceiling_kernel

    g = torch.Generator().manual_seed(3)
    m, k, n, bm, bn, bk = 5, 96, 24, 16, 16, 32
    a = torch.randn(m, k, generator=g).to(device)
    b = torch.randn(k, n, generator=g).to(device)
    ref = a.double() @ b.double()
    halves = [a[:, :48].double() @ b[:48].double(), a[:, 48:].double() @ b[48:].double()]
    for s, load in ((1, True), (2, True), (1, False)):
        out = torch.zeros(m, n, device=device)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), s)
        args = (a, b, out, m, *a.stride(), *b.stride(), *out.stride())
        meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, LOAD=load, PRECISION="ieee", UPCAST=False)
        _ceiling_kernel[grid](*args, N=n, K=k, S=s, **meta)
        got = out.double()
        if not load:
            assert not got.any()
        elif s == 1:
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        else:
            assert any(torch.allclose(got, h, atol=1e-4, rtol=1e-4) for h in halves)


def test_gather_gate_up_probe_contenders_compute_their_products(device, monkeypatch):
    """The gather probe's contenders: gate/up with SwiGLU from the permuted copy, from rows already permuted
    and from x by token id (K not a multiple of BLOCK_K), each against SiLU(gate) * up of the float64
    product on fresh random data; tiles the gathering kernel cannot take leave it out."""
    import torch

    import moegemm.grouped.config as api
    from experiments.e7_grouped_skew import ref_rows
    from moegemm.grouped import GroupedConfig, permute, route
    from probes import probe_gather_gate_up as probe

    e, k, n, t, top_k = 4, 80, 48, 21, 2
    g = torch.Generator().manual_seed(17)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(device)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16).to(device)
    plan = route(ids, e)
    xs = permute(x, plan)
    ref = ref_rows(xs, w, plan.group_offsets)
    names = ["rows+fused", "permute+fused", "gather+fused"]
    for cfg, want in (
        (GroupedConfig(16, 32, 32, num_stages=3, tma=True), names),
        (GroupedConfig(), names[:2]),
    ):
        monkeypatch.setattr(api, "_tuned_table", lambda slug: {})
        monkeypatch.setattr(api, "_default_table", lambda slug, c=cfg: ((c,),) * 4)
        cs = probe.contenders_of(xs, plan, ref, w, t, e, k, n, {}, None, ws=[w], settings=None, x=x, ids=ids)
        assert [c.name for c in cs] == want
        for c in cs:
            out = c.bind((xs, w))()
            assert out.shape == (xs.shape[0], n // 2)
            ok, rel, why = c.check(out)
            assert ok, (c.name, why)
