"""The clustered probes: the Decompose-K kernel (probes.cluster_dk) and the multicast grouped GEMM
(probes.cluster_grouped).

CPU: the variants (every pair of dtype, epilogue, bias, b's layout, cluster size and tile) compile for
sm_90a, and each one's PTX holds the cluster launch and the exchange (``.reqnctapercluster``, ``mapa``,
``st.shared::cluster``, the two cluster barriers, one TMA barrier per CTA); the fallback where the Gluon
features are missing; bad input.
Gluon has no interpreter, so the compile runs in a subprocess without TRITON_INTERPRET (this file as a
script). GPU (``-m gpu``): results against float64 with poisoned outputs, every dtype, epilogue, K tail,
stride class; bitwise identity over 100 repeats; 20 CUDA-graph replays with new inputs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.probe  # the probes' own tests (the pipeline runs no probe)


ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # the compile check runs this file as a script
    sys.path.insert(0, str(ROOT))
from moegemm.decompose_k.reference import reference_mm  # noqa: E402 - after the path set-up
from moegemm.epilogue import Epilogue  # noqa: E402 - after the path set-up
from probes import cluster_dk as C  # noqa: E402 - after the path set-up
from probes import cluster_dk_kernel as K  # noqa: E402 - after the path set-up
from tests.helpers import DTYPES, assert_close_to_ref, make, pairwise, poisoned  # noqa: E402 - after the path set-up

# ----------------------------------------------------------------------------------------------------
# sm_90a compile checks (a subprocess runs this file as a script)
# ----------------------------------------------------------------------------------------------------

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


def compile_variants():
    """(name, dtype key, n, k, config, b_kn, epilogue, bias): every pair of dtype, epilogue, bias, b layout,
    cluster size (S CTAs) and output tile stands in one variant at least (helpers.pairwise), the ring (stages
    below the K steps) and the accumulator chains cycling through them; small K keeps compiles quick."""
    ring = itertools.cycle((0, 2, 0, 4))
    chains = itertools.cycle((1, 2, 4))
    for v in pairwise(
        dt=list(DT),
        epi=list(Epilogue),
        bias=(False, True),
        kn=(True, False),
        s=(1, 2, 4, 8, 16),
        tile=((16, 32), (32, 16), (64, 64), (16, 8)),
    ):
        dt, epi, bias, kn, s, (bm, bn) = v.values()
        bk = 32 if dt in ("fp32", "tf32") else 64
        cfg = C.ClusterConfig(
            split_k=s,
            block_m=bm,
            block_n=bn,
            block_k=bk,
            num_warps=4,
            stages=next(ring),
            chains=next(chains),
        )
        name = f"{dt}-{epi.name.lower()}-{'bias' if bias else 'nobias'}-{'kn' if kn else 'nk'}-S{s}-{bm}x{bn}"
        yield name, dt, 48, 1000 + 7 * s, cfg, kn, epi, bias


EXPECT_TX = r"expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);"


def ptx_facts(ptx: str) -> dict:
    m = re.search(r"\.reqnctapercluster\s+(\d+)", ptx)
    return {
        "reqnctapercluster": int(m.group(1)) if m else 0,
        "mapa": len(re.findall(r"mapa\.shared::cluster", ptx)),
        "st_cluster": len(re.findall(r"st\.shared::cluster\.f32", ptx)),
        "arrive_relaxed": len(re.findall(r"barrier\.cluster\.arrive\.relaxed", ptx)),
        "arrive": len(re.findall(r"barrier\.cluster\.arrive", ptx)),
        "wait": len(re.findall(r"barrier\.cluster\.wait", ptx)),
        "ctarank": len(re.findall(r"%cluster_ctarank", ptx)),
        "clusterid": len(re.findall(r"%clusterid\.x", ptx)),
        "dyn_smem": len(re.findall(r"%dynamic_smem_size", ptx)),
        "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "multicast": len(re.findall(r"multicast::cluster", ptx)),
        "skip_wait": len(re.findall(r"skipWait", ptx)),
        "expect_bytes": sorted({int(b) for b in re.findall(EXPECT_TX, ptx)}),
        "mma": len(re.findall(r"mma\.sync", ptx)),
        "fma": len(re.findall(r"fma\.rn\.f32", ptx)),
        "atom": re.findall(r"atom\.global\.[\w.]+", ptx),
        "ld_cg": len(re.findall(r"ld\.global\.cg", ptx)),
    }


def grouped_variants():
    """(name, dtype, config, w_kn, epilogue, row scale, swiglu) of the multicast grouped kernel."""
    from probes.cluster_grouped import ClusterGroupedConfig

    tiles = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 256, 64, 4, 3), (64, 64, 32, 4, 6)]
    # every pair of dtype, layout, epilogue, row scale and tile
    for v in pairwise(
        dt=("bf16", "fp16"), kn=(True, False), epi=list(Epilogue), scale=(False, True), tile=tiles
    ):
        dt, kn, epi, scale, (bm, bn, bk, nw, st) = v.values()
        cfg = ClusterGroupedConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, stages=st)
        name = f"grouped-{dt}-{'kn' if kn else 'nk'}-{epi.name.lower()}-{'scale' if scale else 'noscale'}"
        yield f"{name}-{bm}x{bn}", dt, cfg, kn, epi, scale, False
    for v in pairwise(dt=("bf16", "fp16"), kn=(True, False), scale=(False, True)):  # fused SwiGLU
        dt, kn, scale = v.values()
        cfg = ClusterGroupedConfig(block_m=64, block_n=128 if scale else 64, num_warps=4, stages=3)
        yield f"grouped-swiglu-{dt}-{'kn' if kn else 'nk'}-{scale}", dt, cfg, kn, Epilogue.NONE, scale, True
    epilogues = itertools.cycle(Epilogue)
    for dt, kn, swiglu in itertools.product(("bf16", "fp16"), (True, False), (False, True)):  # ws, persistent
        cfg = ClusterGroupedConfig(block_m=128, block_n=128, num_warps=8, stages=4, ws=True)
        epi = Epilogue.NONE if swiglu else next(epilogues)
        name = f"grouped-ws-{dt}-{'kn' if kn else 'nk'}-{'swiglu' if swiglu else epi.name.lower()}"
        yield name, dt, cfg, kn, epi, not swiglu, swiglu
    # the slot hand-over at CTA scope, and the refill a step later, in both forms and layouts
    for kn, (scope, lag, ws) in itertools.product(
        (True, False), (("cta", 1, False), ("cluster", 2, False), ("cta", 2, False), ("cta", 1, True))
    ):
        cfg = ClusterGroupedConfig(
            block_m=128, block_n=128, num_warps=8, stages=6, scope=scope, lag=lag, ws=ws
        )
        name = f"grouped-{'ws-' if ws else ''}{scope}-lag{lag}-{'kn' if kn else 'nk'}"
        yield name, "bf16", cfg, kn, Epilogue.NONE, True, False


def _grouped_main() -> int:
    from probes import cluster_grouped as G

    out = []
    for name, dt, cfg, kn, epi, scale, swiglu in grouped_variants():
        w_boxes = 2 if swiglu else 1
        rec = {"name": name, "box_bytes": (cfg.block_m + w_boxes * cfg.block_n) * cfg.block_k * 2}
        try:
            ck = G.compile_sm90(DT[dt], 8, cfg, w_kn=kn, epilogue=epi, has_scale=scale, swiglu=swiglu)
            ptx = ck.asm["ptx"]
            rec.update(
                ptx_facts(ptx),
                ok=True,
                arrive_remote=len(re.findall(r"mbarrier\.arrive(\.release\.cluster)?\.shared::cluster", ptx)),
                cluster_scope=len(
                    re.findall(r"mbarrier\.arrive\.release\.cluster|try_wait\.parity\.acquire\.cluster", ptx)
                ),
                setmaxnreg=len(re.findall(r"setmaxnreg", ptx)),
                ws=cfg.ws,
                scope=cfg.scope,
                shared=int(ck.metadata.shared),
            )
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=str(e).splitlines()[-1][:300] if str(e) else repr(e))
        out.append(rec)
    print(json.dumps(out))
    return 0


@pytest.mark.long
def test_grouped_multicast_kernel_compiles_for_sm90():
    """Every variant of the multicast grouped kernel, and of its warp-specialized form, compiles; its PTX
    holds a 2-CTA cluster, the weight copies with .multicast::cluster, the remote arrives on the barriers
    that free a slot and a barrier per CTA for the copies (each expecting its x half and the whole weight
    box)."""
    if C._gluon_api_ok() is not None:
        pytest.skip(f"this Triton lacks the Gluon features: {C._gluon_api_ok()}")
    recs = _script_records("--grouped")
    assert len(recs) == len(list(grouped_variants())) > 0
    assert any(r["ws"] for r in recs) and not all(r["ws"] for r in recs)
    for r in recs:
        assert r["ok"], r
        # the warp-specialized form: both CTAs' barriers freed at two places (within a tile, after it), its
        # producer warp group's registers set apart
        remote, regs = (4, r["setmaxnreg"] > 0) if r["ws"] else (1, r["setmaxnreg"] == 0)
        assert r["reqnctapercluster"] == 2 and r["multicast"] > 0 and r["arrive_remote"] == remote and regs, r
        # the hand-over's barriers at the scope asked for: the slot's arrive and wait at cluster scope, or
        # none at all with "cta"; every ring within Hopper's 227 KB of shared memory a block
        assert (r["cluster_scope"] == 0) == (r["scope"] == "cta") and 0 < r["shared"] <= 232448, r
        assert r["skip_wait"] == 0 and r["expect_bytes"] == [r["box_bytes"]], r
        # the init sync and the exit barrier (the warp-specialized form: in each of its two partitions, since
        # its producer warps do not run the kernel's own region and a cluster barrier waits for every thread)
        syncs = 4 if r["ws"] else 2
        assert r["wait"] == syncs and r["arrive"] == syncs, r


def _script_records(*args: str) -> list:
    """This file run as a script with ``args`` (compiled for sm_90a, not interpreted): the records it
    prints as JSON on its last line; the run must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=1800, check=False
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _compile_main(shard: int, shards: int) -> int:
    out = []
    for i, (name, dt, n, k, cfg, kn, epi, bias) in enumerate(compile_variants()):
        if i % shards != shard:
            continue
        rec = {"name": name, "s": cfg.split_k, "dt": dt, "box_bytes": 0}
        try:
            ck = C.compile_sm90(
                DT[dt], n, k, cfg, b_kn=kn, epilogue=epi, has_bias=bias, allow_tf32=dt == "tf32"
            )
            esize = 4 if dt in ("fp32", "tf32") else 2
            rec["box_bytes"] = (cfg.block_m + cfg.block_n) * cfg.block_k * esize
            rec.update(ptx_facts(ck.asm["ptx"]), ok=True, shared=int(ck.metadata.shared))
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=str(e).splitlines()[-1][:300] if str(e) else repr(e))
        out.append(rec)
    print(json.dumps(out))
    return 0


class _CompileOnlyDriver:
    """Enough of a CUDA driver for Triton's JIT to bind and compile a kernel for sm_90 on a CPU machine
    (warmup: no launch)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _jit_main() -> int:
    """Bind and compile through Triton's launcher path (the JIT's binder, constexprs, descriptors, options)
    exactly as a launch would, for each operand class; print the facts as JSON."""
    from triton.runtime import driver

    driver.set_active(_CompileOnlyDriver())
    g = torch.Generator().manual_seed(0)
    out = []
    cases = [
        ((16, 8192), (8192, 16), "kn", None, False),
        ((1, 7168), (256, 7168), "wt", None, True),
        ((33, 3000), (3000, 72), "kn", 8, True),
        ((20, 4096), (4096, 48), "kn", 16, False),
        ((64, 2048), (2048, 64), "kn", 1, True),
    ]
    for dtype in (torch.bfloat16, torch.float32):
        for sa, sb, lb, s, bias_on in cases:
            a = torch.randn(*sa, generator=g).to(dtype)
            b = torch.randn(*sb, generator=g).to(dtype)
            b = b.t() if lb == "wt" else b
            m, n = sa[0], b.shape[1]
            bias = torch.randn(n, generator=g).to(dtype) if bias_on else None
            o = torch.empty(n, m, dtype=dtype).t()  # a transposed out
            geo = C._tma_operands(a, b)
            cfg = (
                C.heuristic_config(m, n, sa[1], dtype)
                if s is None
                else C.ClusterConfig(
                    split_k=s, block_m=16, block_n=32, block_k=32 if dtype == torch.float32 else 64
                )
            )
            rec = {"case": f"{dtype} {sa} {lb} S={cfg.split_k}", "s": cfg.split_k, "b_kn": lb == "kn"}
            try:
                p, ck = C.compile_for(a, b, geo, Epilogue.RELU, bias, o, cfg, False)
                names = list(K._cluster_dk_kernel.arg_names)
                rec.update(
                    ok=True,
                    num_ctas=ck.metadata.num_ctas,
                    plan_b_kn=p.b_kn,
                    grid=p.grid,
                    reqn=ptx_facts(ck.asm["ptx"])["reqnctapercluster"],
                    tail=names[names.index("stride_cn") + 1 :]
                    == list(C.constexprs(n, sa[1], dtype, cfg, p.b_kn, Epilogue.RELU, bias_on, False)),
                )
            except Exception as e:  # noqa: BLE001
                rec.update(ok=False, error=repr(e)[-400:])
            out.append(rec)
    from probes import cluster_grouped as G

    cases = (
        (torch.bfloat16, True, False, False),
        (torch.float16, False, True, False),
        (torch.bfloat16, False, True, True),
    )
    for dtype, kn, scale_on, swiglu in cases:
        e, k, n, m = 4, 256, 192, 300
        wn = 2 * n if swiglu else n
        x = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(*((e, k, wn) if kn else (e, wn, k)), generator=g).to(dtype)
        offsets = torch.tensor([0, 100, 100, 250, 300], dtype=torch.int32)
        y = torch.empty(m, n, dtype=dtype)
        scale = torch.rand(m, generator=g).to(dtype) if scale_on else y
        cfg = G.ClusterGroupedConfig()
        rec = {"case": f"grouped {dtype} {'kn' if kn else 'nk'}", "s": 2, "b_kn": kn}
        try:
            ck, c, grid, *_ = G.compile_for(
                x, w, "kn" if kn else "nk", offsets, scale, y, e, n, k, Epilogue.RELU, scale_on, cfg, swiglu
            )
            rec.update(
                ok=True,
                num_ctas=ck.metadata.num_ctas,
                plan_b_kn=c["W_KN"],
                grid=grid,
                reqn=ptx_facts(ck.asm["ptx"])["reqnctapercluster"],
                tail=True,
            )
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=repr(e)[-400:])
        out.append(rec)
    print(json.dumps(out))
    return 0


def test_launch_path_binds_and_compiles_without_a_gpu():
    """Triton's JIT binds every argument (descriptors, constexprs, num_ctas) and compiles what a launch
    would, for b [K, N] and w.t(), a transposed out, a bias, S = 1..16, and the multicast grouped kernel
    in both weight layouts (a fake driver: compile, no launch)."""
    if C._gluon_api_ok() is not None:
        pytest.skip(f"this Triton lacks the Gluon features: {C._gluon_api_ok()}")
    recs = _script_records("--jit")
    assert len(recs) == 13
    for r in recs:
        assert r["ok"], r
        assert r["num_ctas"] == r["s"] and r["plan_b_kn"] == r["b_kn"] and r["tail"], r
        assert r["reqn"] == (r["s"] if r["s"] > 1 else 0), r


SHARDS = 2


@pytest.mark.long
@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_variant_compiles_for_sm90_with_the_cluster_exchange(shard):
    if C._gluon_api_ok() is not None:
        pytest.skip(f"this Triton lacks the Gluon features: {C._gluon_api_ok()}")
    recs = _script_records("--compile", f"{shard}/{SHARDS}")
    assert len(recs) == len(list(compile_variants())[shard::SHARDS]) > 0
    for r in recs:
        assert r["ok"], r
        f = r
        assert f["tma"] > 0 and f["multicast"] == 0, r
        assert f["skip_wait"] == 0, r  # every CTA waits on its own TMA barriers
        assert f["expect_bytes"] == [r["box_bytes"]], r  # its own boxes' bytes, not the cluster's
        assert (f["fma"] > 0) == (r["dt"] == "fp32") and (f["mma"] > 0) == (r["dt"] != "fp32"), r
        if r["s"] > 1:
            assert f["reqnctapercluster"] == r["s"], r
            assert f["mapa"] > 0 and f["mapa"] == f["st_cluster"], r
            assert f["arrive_relaxed"] == 1 and f["arrive"] == 2 and f["wait"] == 2, r
            assert f["ctarank"] >= 1 and f["clusterid"] == 1 and f["dyn_smem"] > 0, r
        else:
            assert f["reqnctapercluster"] == 0 and f["mapa"] == 0 and f["arrive"] == 0 and f["wait"] == 0, r
        # the reduction stays in the cluster's shared memory: no global atomics, no workspace reads
        assert f["atom"] == [] and f["ld_cg"] == 0, r


PLAIN_TRITON_CTAS = r"""
import json, re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def mm(a, b, c, M, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    da = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    db = tl.make_tensor_descriptor(b, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    dc = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(da.load([pm * BM, k]), db.load([pn * BN, k]).T, acc)
    dc.store([pm * BM, pn * BN], acc)

sig = {"a": "*bf16", "b": "*bf16", "c": "*fp32", "M": "i32", "K": "constexpr", "N": "constexpr",
       "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
const = {"K": 4096, "N": 4096, "BM": 128, "BN": 128, "BK": 64}
out = {}
for ctas in (1, 2):
    k = triton.compile(ASTSource(fn=mm, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_ctas": ctas})
    ptx = k.asm["ptx"]
    out[ctas] = {"num_ctas": k.metadata.num_ctas,
                 "cluster": len(re.findall(r"\.reqnctapercluster 2", ptx)),
                 "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                 "multicast": len(re.findall(r"multicast::cluster", ptx)),
                 "dsmem": len(re.findall(r"shared::cluster|mapa", ptx))}
print(json.dumps(out))
"""


def test_plain_triton_num_ctas_forms_a_cluster_but_shares_no_tile(tmp_path):
    """Plain Triton's ``num_ctas=2`` on sm_90 (a TMA-fed matmul compiled for sm_90a on the CPU): with Triton
    3.7 it launches a cluster of two (``.reqnctapercluster 2``) but each CTA copies its own tiles: no TMA
    multicast, no access to the other CTA's shared memory. So it cannot halve the operands' L2 traffic, the
    lever the clustered probes reach for through Gluon."""
    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "plain_ctas.py"  # Triton reads a kernel's source from its file
    script.write_text(PLAIN_TRITON_CTAS)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    one, two = got["1"], got["2"]
    assert one["num_ctas"] == 1 and one["cluster"] == 0 and one["tma"] > 0, one
    assert two["num_ctas"] == 2 and two["cluster"] == 1 and two["tma"] > 0, two
    if triton.__version__.startswith("3.7"):  # the finding, for the Triton the pipeline runs
        assert two["multicast"] == 0 and two["dsmem"] == 0, two


# ----------------------------------------------------------------------------------------------------
# CPU: feature detection, the fallback, configs, bad input
# ----------------------------------------------------------------------------------------------------


def test_gluon_features_detected_on_this_triton():
    """The installed Triton (3.7) has everything the kernel uses; the reason names what is missing else."""
    import triton

    if not triton.__version__.startswith("3.7"):
        pytest.skip(f"triton {triton.__version__}")
    assert C._gluon_api_ok() is None


def test_missing_gluon_features_fall_back(monkeypatch, device):
    """A Triton whose Gluon lacks the features (3.6; or 3.8, where the TMA copy is async_load): not
    supported, no plan, and matmul serves the call through the default kernels, right."""
    C.unsupported_reason.cache_clear()
    monkeypatch.setattr(C, "_PLANS", {})
    monkeypatch.setattr(
        K, "_IMPORT_ERROR", "AttributeError: module 'tma' has no attribute 'async_copy_global_to_shared'"
    )
    try:
        assert not C.cluster_supported()
        assert "async_copy_global_to_shared" in C.unsupported_reason()
        g = torch.Generator().manual_seed(3)
        a = make((5, 300), torch.float32, "contiguous", g, device)
        b = make((300, 7), torch.float32, "contiguous", g, device)
        bias = make((1, 7), torch.float32, "contiguous", g, device)[0]
        assert C.plan(a, b, epilogue="relu", bias=bias) is None
        out = poisoned((5, 7), torch.float32, device)
        got = C.matmul(a, b, epilogue="relu", bias=bias, out=out)
        assert got is out
        assert_close_to_ref(got, reference_mm(a, b, "relu", bias), 300, "fallback")
    finally:
        C.unsupported_reason.cache_clear()


def test_interpreter_falls_back(device):
    """Gluon has no interpreter: under TRITON_INTERPRET=1 the default kernels serve every call."""
    if device != "cpu":
        pytest.skip("on a GPU the clustered kernel runs")
    assert "interpreter" in (C.unsupported_reason() or "")
    g = torch.Generator().manual_seed(4)
    for dtype in DTYPES:
        a = make((3, 130), dtype, "contiguous", g, device)
        b = make((130, 9), dtype, "transposed", g, device)
        got = C.matmul(a, b, epilogue="sigmoid")
        assert_close_to_ref(got, reference_mm(a, b, "sigmoid"), 130, f"interpreter fallback {dtype}")


def test_bad_input_names_the_argument(device):
    a = torch.randn(4, 64, device=device)
    b = torch.randn(64, 8, device=device)
    with pytest.raises(ValueError, match="b: inner dimensions"):
        C.matmul(a, torch.randn(63, 8, device=device))
    with pytest.raises(TypeError, match="b: dtype"):
        C.matmul(a, b.half())
    with pytest.raises(ValueError, match="epilogue"):
        C.matmul(a, b, epilogue="gelu")
    with pytest.raises(ValueError, match="bias: expected shape"):
        C.matmul(a, b, bias=torch.randn(7, device=device))
    with pytest.raises(ValueError, match="out: expected shape"):
        C.matmul(a, b, out=torch.empty(4, 9, device=device))
    with pytest.raises(ValueError, match="config.split_k"):
        C.matmul(a, b, config={"split_k": 3})
    with pytest.raises(ValueError, match="config.block_m"):
        C.matmul(a, b, config={"split_k": 2, "block_m": 24})
    with pytest.raises(ValueError, match="config: unknown keys"):
        C.matmul(a, b, config={"split_k": 2, "xblock": 64})
    with pytest.raises(ValueError, match="config.block_k"):  # fp32 rows of 64 are 256 bytes: no TMA box
        C.matmul(a, b, config={"split_k": 2, "block_k": 64})
    with pytest.raises(ValueError, match="config.chains"):
        C.matmul(a, b, config={"split_k": 2, "chains": 8})
    with pytest.raises(ValueError, match="config.split_k"):  # 16 splits of K = 8
        C.matmul(a[:, :8], b[:8], config={"split_k": 16, "block_k": 16})
    with pytest.raises(ValueError, match="config.num_warps"):
        C.matmul(a, b, config={"split_k": 2, "num_warps": 3})
    with pytest.raises(ValueError, match="config.stages"):
        C.matmul(a, b, config={"split_k": 2, "stages": -1})
    for removed in ("producer", "clusters"):
        with pytest.raises(ValueError, match="config: unknown keys"):
            C.matmul(a, b, config={"split_k": 2, removed: 1})
    with pytest.raises(TypeError, match="config"):
        C.matmul(a, b, config=(2, 16))
    with pytest.raises(TypeError, match="a: expected a torch.Tensor"):
        C.matmul(a.numpy() if device == "cpu" else [1], b)


def test_heuristic_config_spreads_k_over_16_cta_clusters_with_several_chains():
    for m, n, k in [(16, 16, 8192), (64, 64, 32768), (1, 256, 7168), (256, 256, 7168), (33, 70, 300)]:
        for dtype in DTYPES:
            cfg = C.heuristic_config(m, n, k, dtype, 132)
            assert k >= 2 * cfg.split_k * cfg.block_k or cfg.split_k == 1, (m, n, k, cfg)
            assert cfg.block_k * (4 if dtype == torch.float32 else 2) <= 128, cfg
            assert cfg.chains > 1 and cfg.num_warps in (2, 4), cfg
            assert C.stages_for(k, cfg, 4 if dtype == torch.float32 else 2) >= 1
    for m, n, k in [(16, 16, 8192), (64, 64, 32768), (1, 256, 7168)]:
        assert C.heuristic_config(m, n, k, torch.bfloat16, 132).split_k == 16
    # every K step of a CTA in flight where shared memory holds them
    cfg = C.heuristic_config(16, 16, 32768, torch.bfloat16, 132)
    assert C.stages_for(32768, cfg, 2) == C.k_per_split(32768, cfg) // cfg.block_k


def test_ring_slots_are_whole_groups_of_chains():
    """Where the K steps outnumber the slots, the ring holds a whole number of chain groups (a group
    refills its own slots), at least one group; where they fit, one slot per step."""
    for chains in (1, 2, 4):
        for stages in (0, 1, 2, 3, 5, 6, 8):
            for k in (64, 1000, 7168, 32768, 1 << 20):
                cfg = C.ClusterConfig(split_k=4, block_k=64, stages=stages, chains=chains)
                steps = C.k_per_split(k, cfg) // 64
                st = C.stages_for(k, cfg, 2)
                if st < steps:
                    assert st % chains == 0 and st >= chains, (chains, stages, k, st)
                else:
                    assert st == steps or (st == chains and steps < chains), (chains, stages, k, st)
    with pytest.raises(ValueError, match="chains"):
        C.ClusterConfig(split_k=4, chains=3)


def test_split_boundaries_cover_k_once():
    """K per split is a whole number of BLOCK_K steps and the S splits cover [0, K) (the last ones may run
    past K: TMA reads zeros there), so no element of K is summed twice or missed."""
    for k in (1, 63, 64, 1000, 3000, 7168, 8191, 32768):
        for s in (1, 2, 4, 8, 16):
            cfg = C.ClusterConfig(split_k=s, block_k=64)
            kps = C.k_per_split(k, cfg)
            assert kps % 64 == 0 and kps < -(-k // s) + 64, (k, s, kps)
            # CTA r of a tile's cluster starts at r * kps
            assert sum(max(0, min(k, (j + 1) * kps) - j * kps) for j in range(s)) == k, (k, s, kps)


def test_exchange_area_fits_the_budget():
    for s in (2, 4, 8, 16):
        for bm, bn in itertools.product((16, 32, 64, 128), repeat=2):
            cfg = C.ClusterConfig(split_k=s, block_m=bm, block_n=bn)
            sl = -(-bm * bn // s)
            assert C.exchange_bytes(cfg) == s * sl * 4 >= bm * bn * 4
            st = C.stages_for(1 << 20, cfg, 2)
            assert st * C._stage_bytes(cfg, 2) + C.exchange_bytes(cfg) <= C.SMEM_BUDGET or st == 1


# ----------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------


def _ref(a, b, epilogue="none", bias=None):
    return reference_mm(a, b, epilogue, bias, on_cpu=False)


def _need_cluster():
    if not C.cluster_supported(torch.device("cuda")):
        why = C.unsupported_reason(torch.cuda.current_device())
        pytest.skip(f"clustered kernel not supported here: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("epilogue", ["none", "relu", "sigmoid"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_gpu_every_dtype_epilogue_k_tail(dtype, epilogue, has_bias):
    _need_cluster()
    g = torch.Generator(device="cuda").manual_seed(hash((str(dtype), epilogue, has_bias)) % 1000)
    shapes = ((1, 16, 8192), (24, 40, 3000), (64, 256, 7168), (33, 72, 4097 + 3))
    for (m, n, k), s in itertools.product(shapes, (None, 1, 2, 4, 8, 16)):
        if k % (8 if dtype != torch.float32 else 4):
            continue  # rows of a not 16-byte aligned: the fallback (tested below)
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        b = torch.randn(k, n, device="cuda", generator=g).to(dtype)
        bias = torch.randn(n, device="cuda", generator=g).to(dtype) if has_bias else None
        cfg = (
            None
            if s is None
            else C.ClusterConfig(
                split_k=s, block_m=16, block_n=32, block_k=32 if dtype == torch.float32 else 64
            )
        )
        assert C.plan(a, b, epilogue=epilogue, bias=bias, config=cfg) is not None
        out = poisoned((m, n), dtype, "cuda")
        got = C.matmul(a, b, epilogue=epilogue, bias=bias, out=out, config=cfg)
        assert_close_to_ref(got, _ref(a, b, epilogue, bias), k, f"{m}x{n}x{k} S={s} {dtype} {epilogue}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "la,lb,lo",
    [
        ("contiguous", "transposed", "contiguous"),
        ("contiguous", "contiguous", "transposed"),
        ("transposed", "contiguous", "contiguous"),
        ("sliced", "sliced", "contiguous"),
    ],
)
def test_gpu_every_stride_class(dtype, la, lb, lo):
    """b as w.t() (K-contiguous) and a transposed out take the clustered kernel; a column-major a or
    unaligned rows take the default kernels; every one is right."""
    _need_cluster()
    g = torch.Generator().manual_seed(11)
    m, n, k = 20, 48, 4096
    a = make((m, k), dtype, la, g, "cuda")
    b = make((k, n), dtype, lb, g, "cuda")
    out = poisoned((m, n), dtype, "cuda", lo)
    p = C.plan(a, b, epilogue="relu", out=out)
    assert (p is not None) == (la == "contiguous"), (la, lb, lo)
    got = C.matmul(a, b, epilogue="relu", out=out)
    assert_close_to_ref(got, _ref(a, b, "relu"), k, f"strides {la} {lb} {lo}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_grid_and_router(dtype):
    _need_cluster()
    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(mn, mn, k, False) for mn in (16, 32, 48, 64) for k in (8192, 20480, 32768)]
    shapes += [(t, 256, 7168, True) for t in (1, 2, 8, 32, 128, 256)]
    for m, n, k, router in shapes:
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        b = (
            torch.randn(n, k, device="cuda", generator=g).to(dtype).t()
            if router
            else torch.randn(k, n, device="cuda", generator=g).to(dtype)
        )
        assert C.plan(a, b, epilogue="relu") is not None
        got = C.matmul(a, b, epilogue="relu", out=poisoned((m, n), dtype, "cuda"))
        assert_close_to_ref(got, _ref(a, b, "relu"), k, f"{m}x{n}x{k} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_chains_and_stages(dtype):
    """Every accumulator-chain count, a ring shorter than the K steps (whole groups and a tail) or one slot
    per step, S = 1 to 16, tiles from 16 x 8 to 64 x 64, on K tails and both layouts of b. Every K keeps the
    rows 16-byte aligned in every dtype, so that TMA reads them (at K = 4100 a 16-bit row is not, and the
    probe rightly falls back)."""
    _need_cluster()
    g = torch.Generator(device="cuda").manual_seed(11)
    bk = 32 if dtype == torch.float32 else 64
    cfgs = [
        C.ClusterConfig(
            split_k=s,
            block_m=bm,
            block_n=bn,
            block_k=bk,
            num_warps=nw,
            stages=st,
            chains=ch,
        )
        for s, bm, bn, nw, st, ch in [
            (1, 16, 16, 2, 4, 4),
            (4, 16, 32, 2, 0, 2),
            (16, 16, 8, 4, 0, 4),
            (8, 32, 32, 4, 4, 4),
            (16, 16, 16, 4, 8, 2),
            (2, 64, 64, 8, 6, 2),
            (16, 32, 16, 4, 0, 1),
            (8, 16, 16, 2, 2, 1),
            (1, 32, 16, 4, 0, 4),
            (4, 64, 64, 8, 0, 2),
        ]
    ]
    for (m, n, k), kn in [((24, 40, 4104), True), ((1, 256, 7168), False), ((64, 64, 20480 + 8), True)]:
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        b = (
            torch.randn(k, n, device="cuda", generator=g).to(dtype)
            if kn
            else torch.randn(n, k, device="cuda", generator=g).to(dtype).t()
        )
        for cfg in cfgs:
            assert C.plan(a, b, epilogue="relu", config=cfg) is not None, (cfg, C.FALLBACK_REASONS)
            got = C.matmul(a, b, epilogue="relu", config=cfg, out=poisoned((m, n), dtype, "cuda"))
            assert_close_to_ref(got, _ref(a, b, "relu"), k, f"{m}x{n}x{k} kn={kn} {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("s,chains", [(2, 4), (8, 2), (16, 4), (16, 1)])
def test_gpu_bitwise_identical_over_100_repeats(s, chains):
    _need_cluster()
    g = torch.Generator(device="cuda").manual_seed(s)
    a = torch.randn(64, 32768, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(32768, 64, device="cuda", generator=g).to(torch.bfloat16)
    cfg = C.ClusterConfig(split_k=s, block_m=16, block_n=16, num_warps=4, chains=chains)
    first = C.matmul(a, b, epilogue="relu", config=cfg)
    for i in range(100):
        assert torch.equal(C.matmul(a, b, epilogue="relu", config=cfg), first), f"repeat {i} differs"
    assert_close_to_ref(first, _ref(a, b, "relu"), 32768, "bitwise shape")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        None,
        {"split_k": 16, "block_m": 16, "block_n": 16, "num_warps": 4, "chains": 4, "stages": 4},
    ],
    ids=["heuristic", "S16-ring"],
)
def test_gpu_cuda_graph_20_replays_with_new_inputs(config):
    _need_cluster()
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(7, 7168, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(256, 7168, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(7, 256, device="cuda", dtype=torch.bfloat16)
    C.matmul(
        x, w.t(), epilogue="sigmoid", bias=bias, out=out, config=config
    )  # compiles, plans outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        C.matmul(x, w.t(), epilogue="sigmoid", bias=bias, out=out, config=config)
    for i in range(20):
        x.copy_(torch.randn(7, 7168, device="cuda", generator=g))
        w.copy_(torch.randn(256, 7168, device="cuda", generator=g))
        bias.copy_(torch.randn(256, device="cuda", generator=g))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(out, _ref(x, w.t(), "sigmoid", bias), 7168, f"replay {i}")
        eager = C.matmul(x, w.t(), epilogue="sigmoid", bias=bias, config=config)
        assert torch.equal(eager, out), f"replay {i} differs from an eager call"


# ----------------------------------------------------------------------------------------------------
# the multicast grouped kernel
# ----------------------------------------------------------------------------------------------------


def _grouped_ref(x, w, offsets, w_layout, epilogue, scale):
    out = torch.zeros(
        x.shape[0], w.shape[2] if w_layout == "kn" else w.shape[1], dtype=torch.float64, device=x.device
    )
    off = offsets.tolist()
    for e in range(w.shape[0]):
        we = w[e].double() if w_layout == "kn" else w[e].double().t()
        out[off[e] : off[e + 1]] = x[off[e] : off[e + 1]].double() @ we
    out = Epilogue.parse(epilogue).torch_apply(out)
    return out * scale.double()[:, None] if scale is not None else out


def _partition(m, e, g, empty=(1,)):
    cuts = torch.sort(torch.randint(0, m + 1, (e - 1,), generator=g)).values.tolist()
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [m])]
    for i in empty:  # empty experts: their rows go to the next one
        if i < e - 1:
            sizes[i + 1] += sizes[i]
            sizes[i] = 0
    return torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int32)


def test_grouped_falls_back_where_it_cannot_serve(device, monkeypatch):
    """On the CPU (or without the features) the library's grouped_mm serves the call, right."""
    from probes import cluster_grouped as G

    monkeypatch.setattr(G, "gluon", None)
    assert not G.cluster_supported()
    g = torch.Generator().manual_seed(2)
    x = make((40, 48), torch.float32, "contiguous", g, device)
    w = torch.randn(3, 48, 24, generator=g).to(device)
    offsets = _partition(40, 3, g).to(device)
    got = G.grouped_mm(x, w, offsets, epilogue="relu")
    assert_close_to_ref(got, _grouped_ref(x, w, offsets.cpu(), "kn", "relu", None), 48, "grouped fallback")
    with pytest.raises(TypeError, match="config"):
        G.grouped_mm(x, w, offsets, config={"block_m": 64})
    with pytest.raises(ValueError, match="config.block_m"):
        G.ClusterGroupedConfig(block_m=32)
    with pytest.raises(ValueError, match="config.scope"):
        G.ClusterGroupedConfig(scope="gpu")
    for bad in ({"lag": 3}, {"lag": 2, "stages": 2}, {"lag": 2, "ws": True}):
        with pytest.raises(ValueError, match="config.lag"):
            G.ClusterGroupedConfig(**bad)
    with pytest.raises(ValueError, match="w_layout"):
        G.grouped_mm(x, w, offsets, w_layout="mk")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("w_layout", ["kn", "nk"])
@pytest.mark.parametrize("cfg_i", range(8))
def test_gpu_grouped_multicast(dtype, w_layout, cfg_i, monkeypatch):
    from probes import cluster_grouped as G

    if not G.cluster_supported(torch.device("cuda")):
        pytest.skip("multicast grouped kernel not supported here")
    monkeypatch.setattr(G, "_PLANS", {})
    cfg = [
        G.ClusterGroupedConfig(),
        G.ClusterGroupedConfig(block_m=128, num_warps=8, block_n=128, stages=3),
        G.ClusterGroupedConfig(block_n=256, stages=3),
        G.ClusterGroupedConfig(block_m=128, num_warps=8, block_n=128, stages=4, ws=True),
        G.ClusterGroupedConfig(block_n=256, stages=3, ws=True),
        G.ClusterGroupedConfig(block_m=128, num_warps=8, block_n=256, stages=4, scope="cta", lag=2),
        G.ClusterGroupedConfig(block_m=128, num_warps=8, stages=6, lag=2),
        G.ClusterGroupedConfig(block_m=128, num_warps=8, stages=6, scope="cta", ws=True),
    ][cfg_i]
    g = torch.Generator().manual_seed(cfg_i)
    cases = (
        ((1000, 8, 512, 384), "none", False),
        ((777, 5, 320, 200), "relu", True),
        ((64, 4, 1024, 128), "sigmoid", True),
        ((3000, 3, 256, 512), "none", True),
    )
    for (m, e, k, n), epilogue, scale_on in cases:
        x = torch.randn(m, k, generator=g).to(dtype).cuda()
        shape = (e, k, n) if w_layout == "kn" else (e, n, k)
        w = (torch.randn(*shape, generator=g) / 8).to(dtype).cuda()
        offsets = _partition(m, e, g).cuda()
        scale = torch.rand(m, generator=g).to(dtype).cuda() if scale_on else None
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        got = G.grouped_mm(
            x, w, offsets, w_layout=w_layout, epilogue=epilogue, row_scale=scale, config=cfg, out=out
        )
        clustered = [p for p in G._PLANS.values() if p is not None]
        assert clustered, f"fell back: {G.FALLBACK_REASONS}"
        assert_close_to_ref(
            got,
            _grouped_ref(x, w, offsets.cpu(), w_layout, epilogue, scale),
            k,
            f"grouped {m}x{k}x{n} E={e} {w_layout} {dtype} {cfg}",
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("w_layout", ["kn", "nk"])
@pytest.mark.parametrize("ws", [False, True])
def test_gpu_grouped_multicast_swiglu(dtype, w_layout, ws, monkeypatch):
    from probes import cluster_grouped as G

    if not G.cluster_supported(torch.device("cuda")):
        pytest.skip("multicast grouped kernel not supported here")
    monkeypatch.setattr(G, "_PLANS", {})
    g = torch.Generator().manual_seed(3)
    for (m, e, k, i), scale_on in (((1000, 8, 512, 192), True), ((300, 3, 256, 64), False)):
        x = torch.randn(m, k, generator=g).to(dtype).cuda()
        shape = (e, k, 2 * i) if w_layout == "kn" else (e, 2 * i, k)
        w = (torch.randn(*shape, generator=g) / 8).to(dtype).cuda()
        offsets = _partition(m, e, g).cuda()
        scale = torch.rand(m, generator=g).to(dtype).cuda() if scale_on else None
        got = G.grouped_mm_swiglu(
            x,
            w,
            offsets,
            w_layout=w_layout,
            row_scale=scale,
            config=G.ClusterGroupedConfig(block_m=128, num_warps=8, stages=4, ws=ws),
            out=torch.full((m, i), float("nan"), dtype=dtype, device="cuda"),
        )
        assert [p for p in G._PLANS.values() if p is not None], f"fell back: {G.FALLBACK_REASONS}"
        gu = _grouped_ref(x, w, offsets.cpu(), w_layout, "none", None)
        ref = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        ref = ref * scale.double()[:, None] if scale is not None else ref
        assert_close_to_ref(got, ref, k, f"swiglu {m}x{k}x{i} E={e} {w_layout} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [False, True])
def test_gpu_grouped_multicast_graph_replays_new_routing(ws):
    """20 replays of one captured call, each with new x, w and a new split of the rows among the experts
    (the tile map is computed in the kernel from the offsets)."""
    from probes import cluster_grouped as G

    if not G.cluster_supported(torch.device("cuda")):
        pytest.skip("multicast grouped kernel not supported here")
    g = torch.Generator().manual_seed(5)
    m, e, k, n = 2048, 8, 1024, 512
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(e, n, k, generator=g).to(torch.bfloat16).cuda()
    offsets = _partition(m, e, g).cuda()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    cfg = G.ClusterGroupedConfig(block_m=128, num_warps=8, stages=4, ws=ws)
    G.grouped_mm(x, w, offsets, w_layout="nk", out=out, validate=False, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.grouped_mm(x, w, offsets, w_layout="nk", out=out, validate=False, config=cfg)
    for i in range(20):
        x.copy_(torch.randn(m, k, generator=g).to(torch.bfloat16))
        w.copy_((torch.randn(e, n, k, generator=g) / 8).to(torch.bfloat16))
        offsets.copy_(_partition(m, e, g, empty=(i % e,)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(out, _grouped_ref(x, w, offsets.cpu(), "nk", "none", None), k, f"replay {i}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:
        i, n = (int(v) for v in sys.argv[2].split("/"))
        sys.exit(_compile_main(i, n))
    if sys.argv[1:2] == ["--jit"]:
        sys.exit(_jit_main())
    if sys.argv[1:2] == ["--grouped"]:
        sys.exit(_grouped_main())


def test_cluster_bench_refuses_an_unknown_part():
    """probes.cluster_bench --parts takes only the parts it has (checks, dk, grouped), before any GPU work."""
    from probes import cluster_bench

    with pytest.raises(SystemExit):
        cluster_bench.main(["--parts", "multicast"])
