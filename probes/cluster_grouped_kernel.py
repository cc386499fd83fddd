"""Grouped GEMM on 2-CTA clusters with the weight tile multicast (Hopper, sm_90; Gluon; a probe, not part
of the library).

The contiguous layout of :func:`moegemm.grouped.grouped_mm`: ``y[rows of e] = epilogue(x[rows of e] @ W_e) *
row_scale[rows]``. A cluster of two CTAs computes a pair of row tiles of one expert (2 * BLOCK_M rows) by
one column tile: CTA r takes rows ``row0 + r * BLOCK_M ...``. Both need the same weight tile at every K
step, so it is loaded once: the cluster's lead CTA issues one TMA copy with ``.multicast::cluster`` that
lands in both CTAs' shared memory and signals both CTAs' barriers; each CTA copies its own x rows. The weight
tile crosses L2 once for two SMs (what CUTLASS's 2x1x1 clusters do).

Per K step i, ring slot s: each CTA waits for its slot (its ``ready`` barrier counts its x box and the whole
weight box) and issues its ``wgmma`` asynchronously; once step i - 1's wgmma has finished (one group stays
in flight), both CTAs arrive on the lead's ``empty`` barrier of step i - 1's slot (a barrier of the pair:
the lead waits on it), and the next copy into that slot is issued while step i multiplies: by each CTA for
its x rows (it has read the slot itself), by the lead for the weight tile once both have (it writes into
both CTAs' slots). A cluster barrier at the end keeps either CTA from exiting while the
other may still signal it.

The map from cluster to (expert, row pair, column tile) is computed in-kernel from the group offsets, as in
the library's kernels (expert by expert, bands of GROUP_M row pairs column by column); the grid is an upper
bound of the pair tiles and the clusters past the last one exit at once.

:func:`probes.cluster_grouped.grouped_mm_swiglu` fuses the gate and up projections with SwiGLU the same way
(both weight tiles of a K step multicast, two accumulators). Where it cannot serve a call (a Triton without
these Gluon features, not Hopper, operands TMA cannot read, fp32, "kn" with K not a multiple of BLOCK_K), the
library's :func:`moegemm.grouped.grouped_mm` (or ``grouped_mm_swiglu``) runs it.
"""

from __future__ import annotations

import dataclasses

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import constexpr_function
    from triton.experimental.gluon.language.nvidia.hopper import (
        cluster,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - the host's

    _tma_copy = tma.async_copy_global_to_shared
except Exception:  # noqa: BLE001 - unsupported_reason says why; the library's kernels serve
    gluon = None


@dataclasses.dataclass(frozen=True)
class ClusterGroupedConfig:
    """block_m: rows per CTA (the pair covers 2 * block_m rows of one expert); 64 per warp group of 4
    warps; block_n, block_k: the weight tile; stages: ring slots; group_m: row pairs walked together."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    stages: int = 4
    group_m: int = 8

    def __post_init__(self) -> None:
        if self.num_warps not in (4, 8) or self.block_m != 16 * self.num_warps:
            raise ValueError(
                f"config.block_m, num_warps: expected 64 with 4 warps or 128 with 8, got "
                f"{self.block_m}, {self.num_warps}"
            )
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"config.block_n: expected 64, 128 or 256, got {self.block_n!r}")
        if self.block_k not in (32, 64):
            raise ValueError(f"config.block_k: expected 32 or 64, got {self.block_k!r}")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= 8:
            raise ValueError(f"config.stages: expected 2..8, got {self.stages!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"config.group_m: expected an int >= 1, got {self.group_m!r}")


if gluon is not None:

    @constexpr_function
    def _bases(rank, rows):
        """CGA bases of a 2-CTA cluster: CTA r holds the r-th half of dimension 0 (rows), or each CTA holds
        the whole tensor (its own copy)."""
        rank, rows = (getattr(v, "value", v) for v in (rank, rows))
        return [[1 if (rows and d == 0) else 0 for d in range(rank)]]

    @gluon.jit
    def _add(a, b):
        return a + b

    # The pair's "empty" barriers live past Triton's shared memory (8 bytes per slot at the end of the dynamic
    # shared memory): Gluon 3.7.1 lowers an arrive on a barrier shared by two CTAs as a local arrive, so the
    # peer's arrive on the lead's barrier is inline PTX (mapa + mbarrier.arrive.release.cluster).

    @gluon.jit
    def _lane_tensor(NW: gl.constexpr):
        """One int32 per thread (the inline PTX below runs once per thread)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0], cga_layout=_bases(1, False))
        return gl.full([32 * NW], 0, gl.int32, layout)

    @gluon.jit
    def _empty_init(lanes, off, count):
        return gl.inline_asm_elementwise(
            """{
            .reg .pred %xp;
            .reg .u32 %xa, %xd, %xt;
            mov.u32 %xt, %tid.x;
            setp.eq.u32 %xp, %xt, 0;
            mov.u32 %xa, global_smem;
            mov.u32 %xd, %dynamic_smem_size;
            add.u32 %xa, %xa, %xd;
            add.u32 %xa, %xa, $2;
            @%xp mbarrier.init.shared::cta.b64 [%xa], $3;
            @%xp fence.mbarrier_init.release.cluster;
            mov.u32 $0, 0;
            }""",
            "=r,r,r,r",
            [lanes, lanes + off, lanes + count],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _empty_arrive(lanes, off):
        """Thread 0 of this CTA arrives (release, cluster scope) on the lead CTA's barrier at ``off``."""
        return gl.inline_asm_elementwise(
            """{
            .reg .pred %xp;
            .reg .u32 %xa, %xd, %xt, %xz;
            mov.u32 %xt, %tid.x;
            setp.eq.u32 %xp, %xt, 0;
            mov.u32 %xa, global_smem;
            mov.u32 %xd, %dynamic_smem_size;
            add.u32 %xa, %xa, %xd;
            add.u32 %xa, %xa, $2;
            mov.u32 %xz, 0;
            mapa.shared::cluster.u32 %xa, %xa, %xz;
            @%xp mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%xa];
            mov.u32 $0, 0;
            }""",
            "=r,r,r",
            [lanes, lanes + off],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _empty_wait(lanes, off, phase, pred):
        """The lead CTA (every thread) waits (acquire, cluster scope) until the barrier at ``off`` completes
        the phase of parity ``phase``; the other CTA and a false ``pred`` pass at once."""
        return gl.inline_asm_elementwise(
            """{
            .reg .pred %xp, %xq;
            .reg .u32 %xa, %xd, %xr;
            mov.u32 %xr, %cluster_ctarank;
            setp.eq.u32 %xp, %xr, 0;
            setp.ne.u32 %xq, $4, 0;
            and.pred %xp, %xp, %xq;
            @!%xp bra.uni XDONE;
            mov.u32 %xa, global_smem;
            mov.u32 %xd, %dynamic_smem_size;
            add.u32 %xa, %xa, %xd;
            add.u32 %xa, %xa, $2;
            XWAIT:
            mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 %xq, [%xa], $3;
            @!%xq bra.uni XWAIT;
            XDONE:
            mov.u32 $0, 0;
            }""",
            "=r,r,r,r,r",
            [lanes, lanes + off, lanes + phase, lanes + pred],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _coords(
        tile,
        offsets_ptr,
        E,
        N,
        PAIR: gl.constexpr,
        BLOCK_N: gl.constexpr,
        E_BLOCK: gl.constexpr,
        GROUP_M: gl.constexpr,
        WARPS: gl.constexpr,
    ):
        """(expert, first row of the pair, the expert's end row, first column, all pair tiles) of pair tile
        ``tile``: experts in order, bands of GROUP_M row pairs walked column by column."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0], cga_layout=_bases(1, False))
        e = gl.arange(0, E_BLOCK, layout=layout)
        lo = gl.load(offsets_ptr + e, mask=e < E, other=0)
        hi = gl.load(offsets_ptr + e + 1, mask=e < E, other=0)
        pairs = (hi - lo + PAIR - 1) // PAIR
        n_tiles = gl.cdiv(N, BLOCK_N)
        cum = gl.associative_scan(pairs, 0, _add) * n_tiles
        total = gl.sum(pairs, axis=0) * n_tiles
        expert = gl.sum((cum <= tile).to(gl.int32), axis=0)
        sel = e == expert
        row_start = gl.sum(gl.where(sel, lo, 0), axis=0)
        row_end = gl.sum(gl.where(sel, hi, 0), axis=0)
        mt = (row_end - row_start + PAIR - 1) // PAIR
        local = tile - (gl.sum(gl.where(sel, cum, 0), axis=0) - mt * n_tiles)
        band = local // (GROUP_M * n_tiles)
        in_band = local % (GROUP_M * n_tiles)
        band_rows = gl.maximum(gl.minimum(mt - band * GROUP_M, GROUP_M), 1)
        tm = band * GROUP_M + in_band % band_rows
        tn = in_band // band_rows
        return expert, row_start + tm * PAIR, row_end, tn * BLOCK_N, total

    @gluon.jit
    def _w_copies(
        w_desc, w_bufs, u_bufs, bar, expert, k, col0, N, K, W_KN: gl.constexpr, SWIGLU: gl.constexpr, pred
    ):
        """The lead CTA's multicast copies of one K step's weight box (and with SWIGLU the up projection's,
        N columns further on in each expert's 2N)."""
        WN = 2 * N if SWIGLU else N
        if W_KN:
            _tma_copy(w_desc, [expert * K + k, col0], bar, w_bufs, pred=pred, multicast=True)
            if SWIGLU:
                _tma_copy(w_desc, [expert * K + k, N + col0], bar, u_bufs, pred=pred, multicast=True)
        else:
            _tma_copy(w_desc, [expert * WN + col0, k], bar, w_bufs, pred=pred, multicast=True)
            if SWIGLU:
                _tma_copy(w_desc, [expert * WN + N + col0, k], bar, u_bufs, pred=pred, multicast=True)

    @gluon.jit
    def _wgmma(a_smem, w_smem, acc, W_KN: gl.constexpr):
        """Issues the K step's wgmma and returns at once (the caller waits with warpgroup_mma_wait)."""
        if W_KN:
            acc = warpgroup_mma(a_smem, w_smem, acc, is_async=True)
        else:
            acc = warpgroup_mma(a_smem, w_smem.permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _grouped_cluster_kernel(
        a_desc,
        w_desc,
        y_ptr,
        offsets_ptr,
        scale_ptr,
        E,
        N,
        K,
        stride_ym,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        E_BLOCK: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        W_KN: gl.constexpr,
        HAS_SCALE: gl.constexpr,
        EPILOGUE: gl.constexpr,
        SWIGLU: gl.constexpr,
    ):
        """y[rows of e, cols] = epilogue(x[rows] @ W_e[:, cols]) * row_scale[rows]; with SWIGLU
        silu(x @ G_e) * (x @ U_e) * row_scale, w holding each expert's 2N gate-then-up columns (or rows)."""
        NW: gl.constexpr = gl.num_warps()
        PAIR: gl.constexpr = 2 * BLOCK_M
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16], cga_layout=_bases(2, True)
        )
        # x: [PAIR, BLOCK_K] boxes, each CTA holding (and copying) its half; w: one box, multicast to both
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        if SWIGLU:
            u_bufs = gl.allocate_shared_memory(
                w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout
            )
        else:
            u_bufs = w_bufs
        ready = mbarrier.allocate_mbarrier(batch=STAGES)  # one per CTA: its x half and the whole w box
        lanes = _lane_tensor(NW)
        XB: gl.constexpr = 8 * STAGES  # the pair's empty barriers (used on the lead CTA), from the end
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
            _empty_init(lanes, 8 * j - XB, 2)
        fence_async_shared()
        mbarrier.sync_cluster_init()  # both CTAs' barriers exist before either signals the other's

        tile = gl.program_id(0)
        expert, row0, row_end, col0, total = _coords(
            tile, offsets_ptr, E, N, PAIR, BLOCK_N, E_BLOCK, GROUP_M, NW
        )
        if tile < total:
            steps = gl.cdiv(K, BLOCK_K)
            W_BOXES: gl.constexpr = 2 if SWIGLU else 1
            nbytes: gl.constexpr = a_desc.nbytes_per_cta + W_BOXES * w_desc.nbytes_per_cta
            for j in gl.static_range(STAGES):
                if j < steps:
                    mbarrier.expect(ready.index(j), nbytes)
                    _tma_copy(a_desc, [row0, j * BLOCK_K], ready.index(j), a_bufs.index(j))
                    _w_copies(
                        w_desc,
                        w_bufs.index(j),
                        u_bufs.index(j),
                        ready.index(j),
                        expert,
                        j * BLOCK_K,
                        col0,
                        N,
                        K,
                        W_KN,
                        SWIGLU,
                        True,
                    )
            acc = gl.zeros([PAIR, BLOCK_N], gl.float32, acc_layout)
            if SWIGLU:
                acc_up = gl.zeros([PAIR, BLOCK_N], gl.float32, acc_layout)
            # step i's wgmma runs while step i - 1's slot is handed back and refilled (one group in flight)
            for i in range(steps):
                s = i % STAGES
                ph = (i // STAGES) & 1
                mbarrier.wait(ready.index(s), ph)
                acc = _wgmma(a_bufs.index(s), w_bufs.index(s), acc, W_KN)
                if SWIGLU:
                    acc_up = _wgmma(a_bufs.index(s), u_bufs.index(s), acc_up, W_KN)
                    acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if i > 0:  # step i - 1's wgmma (slot p) is done in this warp group
                    p = (i - 1) % STAGES
                    pph = ((i - 1) // STAGES) & 1
                    gl.barrier()  # ... and in every warp group of this CTA ...
                    _empty_arrive(lanes, 8 * p - XB)  # ... which thread 0 tells the lead
                    nxt = i - 1 + STAGES
                    refill = nxt < steps
                    _empty_wait(lanes, 8 * p - XB, pph, refill.to(gl.int32))  # the lead: both CTAs have
                    mbarrier.expect(ready.index(p), nbytes, pred=refill)
                    _tma_copy(a_desc, [row0, nxt * BLOCK_K], ready.index(p), a_bufs.index(p), pred=refill)
                    _w_copies(
                        w_desc,
                        w_bufs.index(p),
                        u_bufs.index(p),
                        ready.index(p),
                        expert,
                        nxt * BLOCK_K,
                        col0,
                        N,
                        K,
                        W_KN,
                        SWIGLU,
                        refill,
                    )
            if SWIGLU:
                acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            rows = row0 + gl.arange(0, PAIR, layout=gl.SliceLayout(1, acc_layout))
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            if HAS_SCALE:
                sc = gl.load(scale_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32)
            if SWIGLU:
                acc = acc / (1.0 + gl.exp(-acc)) * acc_up
            if EPILOGUE == 1:
                acc = gl.where(acc < 0.0, 0.0, acc)
            elif EPILOGUE == 2:
                acc = 1.0 / (1.0 + gl.exp(-acc))
            if HAS_SCALE:
                acc = acc * gl.expand_dims(sc, 1)
            ptrs = y_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ym, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0)
            gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        cluster.arrive()  # neither CTA exits while the other may still signal its barriers
        cluster.wait()
