"""Compile every Triton kernel of moegemm for sm_90 with the installed Triton, without a GPU.

Run as a script (not under TRITON_INTERPRET): ``python tests/compile_check.py``. Prints one line per
variant and exits non-zero if any fails. test_compile_sm90.py runs it; it is also how we checked the GPU
image's Triton (3.6) from a CPU machine.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from helpers import cover, pairwise  # noqa: E402 (tests/, this script's folder)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from experiments.harness.stream import CANDIDATES as STREAM_CANDIDATES  # noqa: E402
from experiments.harness.stream import COLS, _stream_flat_kernel, _stream_tma_kernel  # noqa: E402
from moegemm.decompose_k._partial import _partial_mm_kernel  # noqa: E402
from moegemm.decompose_k.flat import _reduce_flat_kernel  # noqa: E402
from moegemm.decompose_k.single_launch import _single_launch_kernel  # noqa: E402
from moegemm.decompose_k.two_stage import _reduce_tile_kernel  # noqa: E402
from moegemm.grouped import backward as bw  # noqa: E402
from moegemm.grouped import routing_kernels as rk  # noqa: E402
from moegemm.grouped.backward_kernels import (  # noqa: E402
    _grouped_dw_kernel,
    _grouped_dw_tma_kernel,
    _swiglu_bwd_kernel,
)
from moegemm.grouped.checks import _offsets_ok_kernel  # noqa: E402
from moegemm.grouped.config import GROUP_M, swiglu_config  # noqa: E402
from moegemm.grouped.fp8 import config as fp8_config  # noqa: E402
from moegemm.grouped.fp8.kernels import _fp8_grouped_kernel  # noqa: E402
from moegemm.grouped.fp8.quant import AMAX_FLOOR, E4M3_MAX, _quantize_rows_kernel  # noqa: E402
from moegemm.grouped.gather import _gather_swiglu_kernel  # noqa: E402
from moegemm.grouped.kernels import (  # noqa: E402
    _grouped_mm_kernel,
    _grouped_mm_swiglu_tma_kernel,
    _grouped_mm_tma_kernel,
)
from moegemm.grouped.masked_kernels import (  # noqa: E402
    _grouped_mm_masked_kernel,
    _grouped_mm_masked_tma_kernel,
)
from moegemm.grouped.pointwise import _combine_kernel, _silu_mul_kernel  # noqa: E402

TY = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sig(kernel, ptrs: dict, consts: dict) -> tuple[dict, dict]:
    names = kernel.arg_names
    s = {}
    for n in names:
        if n in consts:
            s[n] = "constexpr"
        elif n in ptrs:
            s[n] = ptrs[n]
        else:
            s[n] = "i32"
    return s, consts


def _dk_io(dt: str) -> dict:
    return {
        "a_ptr": TY[dt],
        "b_ptr": TY[dt],
        "c_ptr": TY[dt],
        "bias_ptr": TY[dt],
        "p_ptr": "*fp32",
        "counter_ptr": "*i32",
    }


def _prec(dt: str) -> str:
    return "ieee" if dt == "fp32" else "tf32"


def _grouped_io(dt: str) -> dict:
    return {
        "a_ptr": TY[dt],
        "w_ptr": TY[dt],
        "y_ptr": TY[dt],
        "offsets_ptr": "*i32",
        "scale_ptr": TY[dt],
        "masked_m_ptr": "*i32",
    }


def _grouped_tiles(block_m: int, block_n: int, block_k: int) -> dict:
    """The grouped kernels' tile constexprs, their tile plan sized for up to 256 experts (E_BLOCK)."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, E_BLOCK=256, GROUP_M=GROUP_M)


DTYPES = ("bf16", "fp16", "fp32")
EPILOGUES = (0, 1, 2)


def dk_variants():
    """Decompose-K's kernels: the partial GEMM, the single launch (cooperative or not, two shapes), the
    tile and flat reducers; every dtype, epilogue and bias among them."""
    for dt, even in itertools.product(DTYPES, (True, False)):
        tile = dict(
            BLOCK_M=16,
            BLOCK_N=64,
            BLOCK_K=128 if dt != "fp32" else 64,
            GROUP_M=8,
            EVEN_K=even,
            PRECISION=_prec(dt),
            UPCAST=False,
        )
        yield ("partial", dt, even), _partial_mm_kernel, _dk_io(dt), tile
    for v in pairwise(
        dt=DTYPES,
        epi=EPILOGUES,
        bias=(False, True),
        coop=(True, False),
        shape=((64, 8192, 32), (256, 7168, 7)),
    ):
        dt, (n, k, s), coop = v["dt"], v["shape"], v["coop"]
        sl = dict(
            BLOCK_M=16,
            BLOCK_N=64,
            BLOCK_K=128 if dt != "fp32" else 64,
            GROUP_M=8,
            PRECISION=_prec(dt),
            UPCAST=False,
            N=n,
            K=k,
            S=s,
            SP=triton.next_power_of_2(s),
            SLICE=triton.next_power_of_2(-(-16 * 64 // s)),
            CHUNK=4096 // triton.next_power_of_2(s),
            COOP=coop,
            HAS_BIAS=v["bias"],
            EPILOGUE=v["epi"],
        )
        sio = dict(_dk_io(dt), p_ptr="*i64", counter_ptr="*i64") if coop else _dk_io(dt)
        name = ("single_launch", dt, v["epi"], v["bias"], coop, n, k, s)
        yield name, _single_launch_kernel, sio, sl, {"launch_cooperative_grid": coop}
    for v in pairwise(dt=DTYPES, epi=EPILOGUES, bias=(False, True)):
        consts = dict(BLOCK_M=32, BLOCK_N=32, GROUP_M=8, HAS_BIAS=v["bias"], EPILOGUE=v["epi"])
        yield ("reduce_tile", *v.values()), _reduce_tile_kernel, _dk_io(v["dt"]), consts
    for v in pairwise(dt=DTYPES, epi=EPILOGUES, bias=(False, True), contig=(True, False)):
        consts = dict(XBLOCK=64, RBLOCK=16, C_CONTIGUOUS=v["contig"], HAS_BIAS=v["bias"], EPILOGUE=v["epi"])
        yield ("reduce_flat", *v.values()), _reduce_flat_kernel, _dk_io(v["dt"]), consts


def grouped_variants():
    """The grouped GEMM's forward kernels at the library's tiles: pointer loads (plain, fused SwiGLU,
    masked) in every dtype, and the TMA kernels (16-bit) over warp specialisation, the weight layout, tail
    tiles (their own or merged into the tile before) and the mixed tile order."""
    for v in pairwise(dt=DTYPES, epi=EPILOGUES, scale=(False, True)):
        dt = v["dt"]
        tiles = dict(
            **_grouped_tiles(64, 128, 64),
            EVEN_K=v["scale"],
            PRECISION=_prec(dt),
            UPCAST=False,
            EPILOGUE=v["epi"],
        )
        yield (
            ("grouped", *v.values()),
            _grouped_mm_kernel,
            _grouped_io(dt),
            dict(tiles, HAS_SCALE=v["scale"], SWIGLU=False),
        )
    for v in pairwise(dt=DTYPES, epi=EPILOGUES, even=(False, True), zero_tail=(True, False)):
        dt = v["dt"]
        consts = dict(
            **_grouped_tiles(64, 128, 64),
            EVEN_K=v["even"],
            EPILOGUE=v["epi"],
            PRECISION=_prec(dt),
            UPCAST=False,
            ZERO_TAIL=v["zero_tail"],
        )
        yield ("grouped_masked", *v.values()), _grouped_mm_masked_kernel, _grouped_io(dt), consts
    for dt, scale in itertools.product(DTYPES, (False, True)):  # the fused gate/up with SwiGLU
        consts = dict(
            **_grouped_tiles(64, 64, 64),
            EVEN_K=scale,
            PRECISION=_prec(dt),
            UPCAST=False,
            HAS_SCALE=scale,
            EPILOGUE=0,
            SWIGLU=True,
        )
        yield ("grouped_swiglu", dt, scale), _grouped_mm_kernel, _grouped_io(dt), consts
    for v in pairwise(dt=("bf16", "fp16"), epi=EPILOGUES, kn=(False, True)):
        dt, kn = v["dt"], v["kn"]
        mio = {
            "a_ptr": TY[dt],
            "w_desc": f"tensordesc<{dt}{'[64,128]' if kn else '[128,64]'}>",
            "y_ptr": TY[dt],
            "masked_m_ptr": "*i32",
        }
        consts = dict(
            **_grouped_tiles(64, 128, 64),
            W_KN=kn,
            EPILOGUE=v["epi"],
            UPCAST=False,
        )
        yield ("grouped_masked_tma", *v.values()), _grouped_mm_masked_tma_kernel, mio, consts
    # tails (TAIL_M rows) as tiles of their own or merged into the row tile before them; MIX: the heavy
    # experts' tiles dealt out among the light ones'
    for v in pairwise(
        dt=("bf16", "fp16"),
        epi=EPILOGUES,
        scale=(False, True),
        ws=(False, True),
        kn=(False, True),
        tail=((0, False), (32, False), (32, True)),
        mix=(0, 2),
    ):
        dt, kn, (tail, merge) = v["dt"], v["kn"], v["tail"]
        tio = {
            "a_desc": f"tensordesc<{dt}[64,64]>",
            "w_desc": f"tensordesc<{dt}{'[64,128]' if kn else '[128,64]'}>",
            "at_desc": f"tensordesc<{dt}[{tail or 64},64]>",
            "y_ptr": TY[dt],
            "offsets_ptr": "*i32",
            "scale_ptr": TY[dt],
        }
        consts = dict(
            **_grouped_tiles(64, 128, 64),
            TAIL_M=tail,
            W_KN=kn,
            WARP_SPECIALIZE=v["ws"],
            FLATTEN=v["ws"],
            MERGE_TAIL=merge,
            HAS_SCALE=v["scale"],
            EPILOGUE=v["epi"],
            UPCAST=False,
            MIX=v["mix"],
        )
        yield (
            ("grouped_tma", dt, v["epi"], v["scale"], v["ws"], kn, tail, merge, v["mix"]),
            _grouped_mm_tma_kernel,
            tio,
            consts,
        )


def variants():
    yield from dk_variants()
    yield from grouped_variants()
    # the device-side check of the group offsets
    for ty in ("*i32", "*i64"):
        yield ("check_offsets", ty), _offsets_ok_kernel, {"off_ptr": ty, "ok_ptr": "*i1"}, dict(BLOCK=1024)
    # routing, for every expert-id dtype route takes (the id check's flag among its outputs)
    out = {
        "tok_ptr": "*i32",
        "slot_ptr": "*i32",
        "rows_ptr": "*i32",
        "sizes_ptr": "*i32",
        "offsets_ptr": "*i32",
        "ok_ptr": "*i1",
        "hist_ptr": "*i32",
        "bad_ptr": "*i32",
        "base_ptr": "*i32",
    }
    for ty in ("*i64", "*i32", "*i16", "*u8"):
        ids = dict(out, ids_ptr=ty)
        yield ("route_small", ty), rk._small_kernel, ids, dict(CHUNK=rk.CHUNK, EB=rk.EB)
        chunk, eb = rk.small_blocks(4, 60)  # a decode step's few slots
        yield ("route_small_few", ty), rk._small_kernel, ids, dict(CHUNK=chunk, EB=eb), {"num_warps": 1}
        yield ("route_count", ty), rk._count_kernel, ids, dict(CHUNK=rk.CHUNK, EB=rk.EB)
        yield ("route_place", ty), rk._place_kernel, ids, dict(CHUNK=rk.CHUNK)
    # the one-launch plan and its gathers: every id dtype, (x, weight) dtypes and slot count among them
    for v in pairwise(
        ty=("*i64", "*i32", "*i16", "*u8"),
        dts=(("bf16", "fp32"), ("fp16", "bf16"), ("fp32", "fp32")),
        n=(4, rk.GATHER_SLOTS),
    ):
        (dt, wt), chunk_eb = v["dts"], rk.small_blocks(v["n"], 60)
        gio = dict(out, ids_ptr=v["ty"], x_ptr=TY[dt], xs_ptr=TY[dt], w_ptr=TY[wt], ws_ptr=TY[wt])
        consts = dict(CHUNK=chunk_eb[0], EB=chunk_eb[1], BLOCK_H=max(64, 8192 // chunk_eb[0]))
        yield ("route_gather", v["ty"], dt, wt, chunk_eb[0]), rk._small_gather_kernel, gio, consts
    # the placement with its gathers, past the one-launch plan: every id dtype and (x, weight) dtypes
    for v in pairwise(
        ty=("*i64", "*i32", "*i16", "*u8"), dts=(("bf16", "fp32"), ("fp16", "bf16"), ("fp32", "fp32"))
    ):
        (dt, wt) = v["dts"]
        gio = dict(out, ids_ptr=v["ty"], x_ptr=TY[dt], xs_ptr=TY[dt], w_ptr=TY[wt], ws_ptr=TY[wt])
        consts = dict(CHUNK=rk.CHUNK, BLOCK_H=rk.PLACE_BLOCK_H)
        yield ("route_place_gather", v["ty"], dt, wt), rk._place_gather_kernel, gio, consts
    yield ("route_scan",), rk._scan_kernel, out, dict(PB=rk.PB, EB=rk.EB), {"num_warps": 8}
    # the un-permute's gather and sum
    for dt in ("bf16", "fp16", "fp32"):
        for has_w in (False, True):
            yield (
                ("combine", dt, has_w),
                _combine_kernel,
                {
                    "y_ptr": TY[dt],
                    "rows_ptr": "*i32",
                    "w_ptr": "*fp32" if has_w else "*i32",
                    "out_ptr": TY[dt],
                },
                dict(TOP_K=8, HAS_W=has_w, BLOCK_N=1024),
            )
        yield ("silu_mul", dt), _silu_mul_kernel, {"gu_ptr": TY[dt], "out_ptr": TY[dt]}, dict(BLOCK=1024)
    # E7's memory ceiling, every launch shape it tries
    for dt in ("bf16", "fp16"):
        sio = {
            "w_ptr": TY[dt],
            "x_ptr": TY[dt],
            "y_ptr": TY[dt],
            "sums_ptr": "*fp32",
            "counts_ptr": "*i32",
            "w_desc": f"tensordesc<{dt}[{{}},{COLS}]>",
        }
        for c in STREAM_CANDIDATES:
            opts = {"num_warps": c.num_warps, "num_stages": c.num_stages}
            name = ("stream", c.kind, dt, c.block, c.programs_per_sm, c.num_warps, c.num_stages)
            if c.kind == "tma":
                yield (
                    name,
                    _stream_tma_kernel,
                    dict(sio, w_desc=sio["w_desc"].format(c.block)),
                    dict(BOX_ROWS=c.block, COLS_=COLS, BLOCK=4096),
                    opts,
                )
            else:
                yield name, _stream_flat_kernel, sio, dict(BLOCK=c.block), opts
    # the backward's kernels at the library's tiles: the weight gradient and the SwiGLU backward, their
    # pointer kernels (every dtype, gathered and scaled rows, in place or not) and TMA kernels (16-bit)
    for dt in ("bf16", "fp16", "fp32"):
        t = bw.DW_TILES[DTYPE[dt]]
        dio = {
            "a_ptr": TY[dt],
            "a_idx_ptr": "*i32",
            "b_ptr": TY[dt],
            "b_idx_ptr": "*i32",
            "scale_ptr": "*fp32",
            "offsets_ptr": "*i32",
            "dw_ptr": TY[dt],
        }
        for gather in (True, False):
            consts = dict(
                {k: v for k, v in t.items() if k.isupper()},
                A_IDX=gather,
                B_IDX=gather,
                HAS_SCALE=gather,
                PRECISION="ieee" if dt == "fp32" else "tf32",
                UPCAST=False,
            )
            opts = {"num_warps": t["num_warps"], "num_stages": t["num_stages"]}
            yield ("grouped_dw", dt, gather), _grouped_dw_kernel, dio, consts, opts
        t = bw.SWIGLU_TILES[DTYPE[dt]]
        sio = {n: TY[dt] for n in ("x_ptr", "wgu_ptr", "gu_ptr", "dy_ptr", "wd_ptr", "dgu_ptr", "act_ptr")}
        sio.update(
            x_idx_ptr="*i32", dy_idx_ptr="*i32", scale_ptr="*fp32", offsets_ptr="*i32", part_ptr="*fp32"
        )
        # (recompute, P's GEMM in the K loop, in place): the grouped_mm_swiglu backward, moe_ffn's in fp32,
        # and moe_ffn's pointwise pass over a P given (16-bit)
        forms = [(True, False, False), (False, True, True)] + ([(False, False, True)] if dt != "fp32" else [])
        for recompute, p_gemm, in_place in forms:
            consts = dict(
                {k: v for k, v in t.items() if k.isupper()},
                E_BLOCK=256,
                EVEN_K=False,
                RECOMPUTE=recompute,
                P_GEMM=p_gemm,
                X_IDX=recompute,
                DY_IDX=p_gemm,
                HAS_SCALE=True,
                ROWDOT=True,
                STORE_ACT=not recompute,
                IN_PLACE=in_place,
                PRECISION="ieee" if dt == "fp32" else "tf32",
                UPCAST=False,
            )
            opts = {"num_warps": t["num_warps"], "num_stages": t["num_stages"]}
            yield ("swiglu_bwd", dt, recompute, p_gemm, in_place), _swiglu_bwd_kernel, sio, consts, opts
        if dt == "fp32":
            continue
        t = bw.DW_TMA_TILES
        tio = {
            "a_desc": f"tensordesc<{dt}[{t['BLOCK_M']},{t['BLOCK_K']}]>",
            "b_desc": f"tensordesc<{dt}[{t['BLOCK_M']},{t['BLOCK_N']}]>",
            "a_ptr": TY[dt],
            "b_ptr": TY[dt],
            "offsets_ptr": "*i32",
            "dw_ptr": TY[dt],
        }
        consts = dict({k: v for k, v in t.items() if k.isupper()}, UPCAST=False)
        opts = {"num_warps": t["num_warps"], "num_stages": t["num_stages"]}
        yield ("grouped_dw_tma", dt), _grouped_dw_tma_kernel, tio, consts, opts
    yield from tuner_variants()


def _tile(c) -> tuple:
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.tma, c.flatten)


def _grouped_facets(c) -> set:
    """What a tuner config asks of the grouped kernel's compile: its tile, its stage count in its loop form,
    its tail tile (TAIL_M rows in the tile's columns and K step, its own or merged into the row tile
    before), its tile order."""
    facets = {("tile", *_tile(c)), ("stages", c.tma, c.flatten, c.num_stages), ("mix", c.mix)}
    if c.tail_m:
        facets.add(("tail", c.tail_m, c.merge_tail, c.block_n, c.block_k, c.num_warps, c.flatten))
    return facets


def _swiglu_facets(c) -> set:
    """The fused SwiGLU kernel's tile for a tuner config (swiglu_config) and its stage count."""
    sw = swiglu_config(c)
    return {("tile", *_tile(sw), sw.mix), ("stages", sw.flatten, c.num_stages)}


def _masked_facets(c) -> set:
    """The masked layout's TMA kernel's tile for a tuner config and its stage count."""
    return {("tile", *_tile(c)), ("stages", c.num_stages)}


def tuner_variants():
    """Every tile the grouped tuner tries (bf16, with its warps and stages) builds in each kernel it is tried
    in: the grouped kernel (pointer or TMA loads, the flattened warp-specialized loop, tail tiles of their
    own or merged), the masked layout's TMA kernel (tiles without tails or flattened loop) and the fused
    SwiGLU kernel on the tiles it derives (TMA configs). Each kernel builds each distinct tile it gets,
    every stage count of each of its loop forms and every tail tile once: the fewest of the tuner's
    configs that hold them all (helpers.cover), not every config."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from experiments.tune_grouped import candidates

    configs = {}
    for mean_rows in (1, 64, 512):
        for c in candidates(mean_rows):
            configs.setdefault((*_tile(c), c.num_stages, c.tail_m, c.merge_tail, c.mix), c)
    configs = list(configs.values())

    def name(form: str, c) -> tuple:
        return (form, c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, GROUP_M, c.tma, c.flatten,
                c.tail_m, c.merge_tail, c.mix)  # fmt: skip

    def opts(c) -> dict:
        return {"num_warps": c.num_warps, "num_stages": c.num_stages}

    gio = {"a_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offsets_ptr": "*i32", "scale_ptr": "*bf16"}
    for c in cover(configs, _grouped_facets):
        tiles = dict(
            **_grouped_tiles(c.block_m, c.block_n, c.block_k),
            HAS_SCALE=False,
            EPILOGUE=0,
            UPCAST=False,
        )
        if c.tma:
            tio = {
                "a_desc": f"tensordesc<bf16[{c.block_m},{c.block_k}]>",
                "w_desc": f"tensordesc<bf16[{c.block_n},{c.block_k}]>",
                "at_desc": f"tensordesc<bf16[{c.tail_m or c.block_m},{c.block_k}]>",
                "y_ptr": "*bf16",
                "offsets_ptr": "*i32",
                "scale_ptr": "*bf16",
            }
            consts = dict(
                tiles,
                TAIL_M=c.tail_m,
                W_KN=False,
                WARP_SPECIALIZE=c.flatten,
                FLATTEN=c.flatten,
                MERGE_TAIL=c.merge_tail,
                MIX=c.mix,
            )
            yield name("grouped_tune", c), _grouped_mm_tma_kernel, tio, consts, opts(c)
        else:
            consts = dict(tiles, EVEN_K=True, PRECISION="tf32", SWIGLU=False)
            yield name("grouped_tune", c), _grouped_mm_kernel, gio, consts, opts(c)
    for c in cover([c for c in configs if c.tma and not (c.flatten or c.tail_m)], _masked_facets):
        mio = {
            "a_ptr": "*bf16",
            "w_desc": f"tensordesc<bf16[{c.block_n},{c.block_k}]>",
            "y_ptr": "*bf16",
            "masked_m_ptr": "*i32",
        }
        consts = dict(
            **_grouped_tiles(c.block_m, c.block_n, c.block_k),
            W_KN=False,
            EPILOGUE=0,
            UPCAST=False,
        )
        yield name("grouped_masked_tune", c), _grouped_mm_masked_tma_kernel, mio, consts, opts(c)
    for j, c in enumerate(cover([c for c in configs if c.tma], _swiglu_facets)):
        sw = swiglu_config(c)
        sio = {
            "a_desc": f"tensordesc<bf16[{sw.block_m},{sw.block_k}]>",
            "w_desc": f"tensordesc<bf16[{sw.block_n},{sw.block_k}]>",
            "y_ptr": "*bf16",
            "offsets_ptr": "*i32",
            "scale_ptr": "*bf16",
        }
        consts = dict(
            **_grouped_tiles(sw.block_m, sw.block_n, sw.block_k),
            W_KN=False,
            WARP_SPECIALIZE=sw.flatten,
            FLATTEN=sw.flatten,
            HAS_SCALE=False,
            UPCAST=False,
            MIX=sw.mix,
        )
        yield name("grouped_swiglu_tune", c), _grouped_mm_swiglu_tma_kernel, sio, consts, opts(c)
        # gate/up gathering x's rows by token id, on the same tiles (weight layouts and 16-bit dtypes in turn)
        for layout_kn, dt in ((False, "bf16"), (True, "fp16"))[j % 2 : j % 2 + 1]:
            box = [sw.block_k, sw.block_n] if layout_kn else [sw.block_n, sw.block_k]
            gio = {
                "x_ptr": TY[dt],
                "tok_ptr": "*i32",
                "w_desc": f"tensordesc<{dt}[{box[0]},{box[1]}]>",
                "y_ptr": TY[dt],
                "offsets_ptr": "*i32",
            }
            consts = dict(
                **_grouped_tiles(sw.block_m, sw.block_n, sw.block_k),
                W_KN=layout_kn,
                EVEN_K=layout_kn,
                UPCAST=False,
            )
            yield name(f"grouped_gather_{dt}", c), _gather_swiglu_kernel, gio, consts, opts(c)


def fp8_variants():
    """The FP8 grouped kernel in both layouts, pointer and TMA loads, plain and with SwiGLU, and through TMA
    every other tile of the first call's shortlists (moegemm.grouped.fp8.config); the row quantisation,
    plain and gathering."""
    fp8 = dict(BLOCK=128, E_BLOCK=256, GROUP_M=8, AMAX_FLOOR=AMAX_FLOOR, E4M3_MAX=E4M3_MAX)
    both = ((64, 128), (128, 256), (16, 64))
    short = sorted({t[:2] for _, tiles in fp8_config.SHORTLISTS for t in tiles} - set(both))
    for (bm, bn), masked, swiglu, tma in itertools.product(both + tuple(short), *((False, True),) * 3):
        if (swiglu and (masked or bn != 128)) or (masked and bm == 128) or (not tma and (bm, bn) in short):
            continue
        io = {
            "a_ptr": "*fp8e4nv",
            "sa_ptr": "*fp32",
            "w_ptr": "*fp8e4nv",
            "sw_ptr": "*fp32",
            "a_desc": f"tensordesc<fp8e4nv[{bm},128]>" if tma else "*fp8e4nv",
            "w_desc": f"tensordesc<fp8e4nv[{bn},128]>" if tma else "*fp8e4nv",
            "y_ptr": "*fp8e4nv" if swiglu else "*bf16",
            "sy_ptr": "*fp32",
            "counts_ptr": "*i32",
            "scale_ptr": "*fp32",
        }
        consts = dict(fp8, BLOCK_M=bm, BLOCK_N=bn, MASKED=masked, ZERO_TAIL=masked, HAS_SCALE=not masked)
        yield (("fp8_grouped", bm, bn, masked, swiglu, tma), _fp8_grouped_kernel, io,
               dict(consts, SWIGLU=swiglu, TMA=tma), {"num_warps": 8 if bm == 128 else 4})  # fmt: skip
    for gather in (False, True):
        io = {"x_ptr": "*bf16", "rows_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        consts = dict(GATHER=gather, ROWS=16, BLOCK=128, AMAX_FLOOR=AMAX_FLOOR, E4M3_MAX=E4M3_MAX)
        yield ("fp8_quantize_rows", gather), _quantize_rows_kernel, io, consts


def main(argv=None) -> int:
    """``--shard I/N``: compile only the variants whose index is I modulo N (the test runs N shards in
    parallel processes)."""
    args = sys.argv[1:] if argv is None else argv
    i, n = (int(v) for v in args[1].split("/")) if args[:1] == ["--shard"] else (0, 1)
    target = GPUTarget("cuda", 90, 32)
    failed = done = 0
    every = list(variants()) + list(fp8_variants())
    for name, kernel, io, consts, *opts in every[i::n]:
        done += 1
        s, c = sig(kernel, io, consts)
        try:
            triton.compile(
                ASTSource(fn=kernel, signature=s, constexprs=c),
                target=target,
                options=opts[0] if opts else None,
            )
            print("ok  ", name)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print("FAIL", name, str(e).splitlines()[0][:200])
    print(f"{failed} failed of {done} (shard {i}/{n} of {len(every)} variants), triton {triton.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
