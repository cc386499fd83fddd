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

Two settings of the hand-over, each a probe's question (is the pair's per-step handshake what holds this
kernel below the unclustered one?): ``scope="cta"`` frees and waits for slots with the PTX defaults
(release / acquire at CTA scope, as CUTLASS's cluster barriers do) in place of cluster scope; ``lag=2`` has
the lead refill, during step i, the slot of step i - 2, which the other CTA freed a step earlier, so that
its wait for the other CTA's arrival is off the path of its next wgmma (one slot fewer ahead).

``ClusterGroupedConfig(ws=True)`` runs the warp-specialized form (the kernel's ``WS``): the same pair tiles
on a persistent grid of clusters, a producer warp group per CTA issuing every copy into the ring while the
consumer warp groups only wait, multiply, free slots and store, so a tile's epilogue overlaps the next
tile's copies (the split CUTLASS's Hopper kernels make). Its slot hand-over is symmetric: each CTA's
"empty" barrier of a slot counts every consumer warp group of both CTAs.
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

    from probes.gluon_grouped import tile_coords, tile_plan

    _tma_copy = tma.async_copy_global_to_shared
except Exception:  # noqa: BLE001 - unsupported_reason says why; the library's kernels serve
    gluon = None


@dataclasses.dataclass(frozen=True)
class ClusterGroupedConfig:
    """block_m: rows per CTA (the pair covers 2 * block_m rows of one expert); 64 per warp group of 4
    warps; block_n, block_k: the weight tile; stages: ring slots; group_m: row pairs walked together; ws:
    the warp-specialized, persistent form (a producer warp group per CTA beside the num_warps that
    multiply)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    stages: int = 4
    group_m: int = 8
    ws: bool = False  # warp-specialized on a persistent grid (the kernel's WS form)
    # the memory order of the barriers the pair frees slots on: "cluster" (release/acquire at cluster scope)
    # or "cta" (the PTX defaults, CTA scope, as CUTLASS's cluster barriers use them)
    scope: str = "cluster"
    # (not ws) the lead refills the slot of step i - lag during step i: 1 waits for the other CTA to free the
    # slot it has just used; 2 for the slot before, which it freed a step earlier, one slot less ahead
    lag: int = 1

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
        if not isinstance(self.ws, bool):
            raise ValueError(f"config.ws: expected a bool, got {self.ws!r}")
        if self.scope not in ("cluster", "cta"):
            raise ValueError(f"config.scope: expected 'cluster' or 'cta', got {self.scope!r}")
        if self.lag not in (1, 2) or self.lag >= self.stages or (self.ws and self.lag != 1):
            raise ValueError(
                f"config.lag: expected 1, or 2 with at least 3 stages and not ws, got {self.lag!r} "
                f"({self.stages} stages, ws={self.ws})"
            )


if gluon is not None:

    @constexpr_function
    def _bases(rank, rows):
        """CGA bases of a 2-CTA cluster: CTA r holds the r-th half of dimension 0 (rows), or each CTA holds
        the whole tensor (its own copy)."""
        rank, rows = (getattr(v, "value", v) for v in (rank, rows))
        return [[1 if (rows and d == 0) else 0 for d in range(rank)]]

    @constexpr_function
    def _arrive_op(scope_cta):
        """The remote arrive: release at cluster scope, or the PTX defaults (release, CTA scope)."""
        cta = getattr(scope_cta, "value", scope_cta)
        return (
            "mbarrier.arrive.shared::cluster.b64"
            if cta
            else "mbarrier.arrive.release.cluster.shared::cluster.b64"
        )

    @constexpr_function
    def _wait_op(scope_cta):
        """The wait: acquire at cluster scope, or the PTX defaults (acquire, CTA scope)."""
        cta = getattr(scope_cta, "value", scope_cta)
        return (
            "mbarrier.try_wait.parity.shared::cta.b64"
            if cta
            else "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64"
        )

    @constexpr_function
    def _ptx(template, op=""):
        """An inline PTX template with OP replaced by ``op`` and ADDR by the address of the barrier at the
        offset in $2 past the end of the dynamic shared memory (into %xa; %xd its scratch register)."""
        addr = (
            "mov.u32 %xa, global_smem;\n"
            "            mov.u32 %xd, %dynamic_smem_size;\n"
            "            add.u32 %xa, %xa, %xd;\n"
            "            add.u32 %xa, %xa, $2;"
        )
        text = getattr(template, "value", template).replace("ADDR", addr)
        return text.replace("OP", getattr(op, "value", op))

    @gluon.jit
    def _barrier_asm(asm: gl.constexpr, constraints: gl.constexpr, args):
        """``asm`` run once per thread on ``args`` (lanes first), for its side effects."""
        return gl.inline_asm_elementwise(asm, constraints, args, dtype=gl.int32, is_pure=False, pack=1)

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
        return _barrier_asm(
            _ptx(
                """{
            .reg .pred %xp;
            .reg .u32 %xa, %xd, %xt;
            mov.u32 %xt, %tid.x;
            setp.eq.u32 %xp, %xt, 0;
            ADDR
            @%xp mbarrier.init.shared::cta.b64 [%xa], $3;
            @%xp fence.mbarrier_init.release.cluster;
            mov.u32 $0, 0;
            }"""
            ),
            "=r,r,r,r",
            (lanes, lanes + off, lanes + count),
        )

    @gluon.jit
    def _remote_arrive(lanes, off, rank, mask, SCOPE_CTA: gl.constexpr):
        """The threads whose id has no bit of ``mask`` set (mask -1: thread 0; 127: the first of each warp
        group) arrive (release, at cluster scope unless SCOPE_CTA) on the barrier at ``off`` of CTA ``rank``
        of the cluster."""
        return _barrier_asm(
            _ptx(
                """{
            .reg .pred %xp;
            .reg .u32 %xa, %xd, %xt;
            mov.u32 %xt, %tid.x;
            and.b32 %xt, %xt, $4;
            setp.eq.u32 %xp, %xt, 0;
            ADDR
            mapa.shared::cluster.u32 %xa, %xa, $3;
            @%xp OP _, [%xa];
            mov.u32 $0, 0;
            }""",
                _arrive_op(SCOPE_CTA),
            ),
            "=r,r,r,r,r",
            (lanes, lanes + off, lanes + rank, lanes + mask),
        )

    @gluon.jit
    def _empty_arrive(lanes, off, SCOPE_CTA: gl.constexpr):
        """Thread 0 of this CTA arrives (release) on the lead CTA's barrier at ``off``."""
        return _remote_arrive(lanes, off, 0, -1, SCOPE_CTA)

    @gluon.jit
    def _empty_wait(lanes, off, phase, pred, SCOPE_CTA: gl.constexpr):
        """The lead CTA (every thread) waits (acquire, at cluster scope unless SCOPE_CTA) until the barrier at
        ``off`` completes the phase of parity ``phase``; the other CTA and a false ``pred`` pass at once."""
        return _barrier_asm(
            _ptx(
                """{
            .reg .pred %xp, %xq;
            .reg .u32 %xa, %xd, %xr;
            mov.u32 %xr, %cluster_ctarank;
            setp.eq.u32 %xp, %xr, 0;
            setp.ne.u32 %xq, $4, 0;
            and.pred %xp, %xp, %xq;
            @!%xp bra.uni XDONE;
            ADDR
            XWAIT:
            OP %xq, [%xa], $3;
            @!%xq bra.uni XWAIT;
            XDONE:
            mov.u32 $0, 0;
            }""",
                _wait_op(SCOPE_CTA),
            ),
            "=r,r,r,r,r",
            (lanes, lanes + off, lanes + phase, lanes + pred),
        )

    @gluon.jit
    def _pair_plan(
        offsets_ptr,
        E,
        N,
        PAIR: gl.constexpr,
        BLOCK_N: gl.constexpr,
        E_BLOCK: gl.constexpr,
        WARPS: gl.constexpr,
    ):
        """(expert ids, first rows, end rows, inclusive prefix of pair tiles per expert, all pair tiles): the
        Gluon probe's tile_plan over tiles of PAIR rows, in a layout over the WARPS warps of the caller (each
        CTA of the pair holding all of it): experts in order, each its row pairs by the column tiles."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0], cga_layout=_bases(1, False))
        return tile_plan(offsets_ptr, E, N, PAIR, BLOCK_N, E_BLOCK, layout)

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
        ``tile``."""
        e, lo, hi, cum, total = _pair_plan(offsets_ptr, E, N, PAIR, BLOCK_N, E_BLOCK, WARPS)
        expert, row0, row_end, col0 = tile_coords(tile, e, lo, hi, cum, N, PAIR, BLOCK_N, GROUP_M)
        return expert, row0, row_end, col0, total

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
    def _store_pair(
        acc, acc_up, y_ptr, scale_ptr, row0, row_end, col0, N, stride_ym,
        HAS_SCALE: gl.constexpr, EPILOGUE: gl.constexpr, SWIGLU: gl.constexpr,
    ):  # fmt: skip
        """The pair tile's epilogue (SwiGLU of the two products, or the epilogue; then row_scale) and its
        store from registers, each CTA its rows, those of the expert (< row_end) and columns < N."""
        rows = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
        cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
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

    @gluon.jit
    def _ring(
        a_desc, w_desc, STAGES: gl.constexpr, SWIGLU: gl.constexpr, NW: gl.constexpr, FREE: gl.constexpr
    ):
        """The ring of STAGES slots: x boxes, weight boxes (and the up projection's with SWIGLU), a barrier
        per slot and CTA for its copies (one per CTA: its x half and the whole weight box), and the "empty"
        barriers past Triton's shared memory, each completed by FREE arrivals, initialised and fenced.
        Returns the slots, the copies' barriers and a lane tensor over NW warps."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        if SWIGLU:
            u_bufs = gl.allocate_shared_memory(
                w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout
            )
        else:
            u_bufs = w_bufs
        ready = mbarrier.allocate_mbarrier(batch=STAGES)
        lanes = _lane_tensor(NW)
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
            _empty_init(lanes, 8 * j - 8 * STAGES, FREE)
        fence_async_shared()
        return a_bufs, w_bufs, u_bufs, ready, lanes

    # The warp-specialized form: the same pair tiles and copies, on a persistent grid of clusters, the warps
    # split as in CUTLASS's Hopper kernels. A producer warp group per CTA only issues the TMA copies into the
    # ring (its x rows; on the lead, the multicast weight boxes), the consumer warp groups only multiply and
    # store.
    # Every CTA has an "empty" barrier per slot (past Triton's shared memory, as above), which both CTAs'
    # consumer warp groups release: a CTA's producer refills a slot once both CTAs are done with it, so the
    # lead's multicast never lands in a slot the other CTA still reads, and the other CTA's barrier of the
    # copies has completed its phase before the lead's next copy signals it.

    @gluon.jit
    def _pair_release(lanes, off, SCOPE_CTA: gl.constexpr):
        """The first thread of each warp group arrives (release) on the barrier at ``off`` of both CTAs of
        the pair."""
        _remote_arrive(lanes, off, 0, 127, SCOPE_CTA)
        return _remote_arrive(lanes, off, 1, 127, SCOPE_CTA)

    @gluon.jit
    def _slot_wait(lanes, off, phase, SCOPE_CTA: gl.constexpr):
        """Every thread of the caller waits (acquire, at cluster scope unless SCOPE_CTA) until this CTA's
        barrier at ``off`` completes the phase of parity ``phase`` (a fresh barrier passes parity 1 at
        once)."""
        return _barrier_asm(
            _ptx(
                """{
            .reg .pred %xq;
            .reg .u32 %xa, %xd;
            ADDR
            XWAIT:
            OP %xq, [%xa], $3;
            @!%xq bra.uni XWAIT;
            mov.u32 $0, 0;
            }""",
                _wait_op(SCOPE_CTA),
            ),
            "=r,r,r,r",
            (lanes, lanes + off, lanes + phase),
        )

    @gluon.jit
    def _ws_producer(
        a_desc,
        w_desc,
        offsets_ptr,
        a_bufs,
        w_bufs,
        u_bufs,
        ready,
        E,
        N,
        K,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        E_BLOCK: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        W_KN: gl.constexpr,
        SWIGLU: gl.constexpr,
        SCOPE_CTA: gl.constexpr,
    ):
        """One warp group per CTA (one thread issues): per K step of every pair tile of this cluster, wait
        until both CTAs have freed the slot, then copy this CTA's x rows into it and (the lead) the weight
        boxes into both CTAs' slot."""
        PAIR: gl.constexpr = 2 * BLOCK_M
        XB: gl.constexpr = 8 * STAGES
        W_BOXES: gl.constexpr = 2 if SWIGLU else 1
        nbytes: gl.constexpr = a_desc.nbytes_per_cta + W_BOXES * w_desc.nbytes_per_cta
        lanes = _lane_tensor(4)
        e, lo, hi, cum, total = _pair_plan(offsets_ptr, E, N, PAIR, BLOCK_N, E_BLOCK, 4)
        steps = gl.cdiv(K, BLOCK_K)
        it = 0
        cluster.arrive()  # both CTAs' barriers exist (their init fenced) before either signals the other's
        cluster.wait()
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            expert, row0, row_end, col0 = tile_coords(tile, e, lo, hi, cum, N, PAIR, BLOCK_N, GROUP_M)
            for kk in range(steps):
                s = it % STAGES
                _slot_wait(lanes, 8 * s - XB, ((it // STAGES) & 1) ^ 1, SCOPE_CTA)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_copy(a_desc, [row0, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
                _w_copies(
                    w_desc,
                    w_bufs.index(s),
                    u_bufs.index(s),
                    ready.index(s),
                    expert,
                    kk * BLOCK_K,
                    col0,
                    N,
                    K,
                    W_KN,
                    SWIGLU,
                    True,
                )
                it += 1
        cluster.arrive()  # neither CTA exits while the other may still signal its barriers
        cluster.wait()

    @gluon.jit
    def _ws_consumer(
        y_ptr,
        offsets_ptr,
        scale_ptr,
        a_bufs,
        w_bufs,
        u_bufs,
        ready,
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
        NW: gl.constexpr,
        SCOPE_CTA: gl.constexpr,
    ):
        """The NW warps (whole warp groups) of each CTA: per K step wait for the slot's copies, issue the
        wgmma on it, wait for the one before (one stays in flight) and free that one's slot in both CTAs;
        after a tile's last step wait for all, free the last slot and store the tile while the producer
        already fills the ring for the next."""
        PAIR: gl.constexpr = 2 * BLOCK_M
        XB: gl.constexpr = 8 * STAGES
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16], cga_layout=_bases(2, True)
        )
        lanes = _lane_tensor(NW)
        e, lo, hi, cum, total = _pair_plan(offsets_ptr, E, N, PAIR, BLOCK_N, E_BLOCK, NW)
        steps = gl.cdiv(K, BLOCK_K)
        it = 0
        cluster.arrive()  # as in the producer: every warp of both CTAs takes part in a cluster barrier
        cluster.wait()
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            expert, row0, row_end, col0 = tile_coords(tile, e, lo, hi, cum, N, PAIR, BLOCK_N, GROUP_M)
            acc = gl.zeros([PAIR, BLOCK_N], gl.float32, acc_layout)
            acc_up = acc
            for kk in range(steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = _wgmma(a_bufs.index(s), w_bufs.index(s), acc, W_KN)
                if SWIGLU:
                    acc_up = _wgmma(a_bufs.index(s), u_bufs.index(s), acc_up, W_KN)
                    acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if kk > 0:
                    _pair_release(lanes, 8 * ((it + STAGES - 1) % STAGES) - XB, SCOPE_CTA)
                it += 1
            if SWIGLU:
                acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                acc_up = acc
            _pair_release(lanes, 8 * ((it + STAGES - 1) % STAGES) - XB, SCOPE_CTA)
            _store_pair(
                acc, acc_up, y_ptr, scale_ptr, row0, row_end, col0, N, stride_ym, HAS_SCALE, EPILOGUE, SWIGLU
            )
        cluster.arrive()
        cluster.wait()

    @gluon.jit
    def _grouped_cluster_kernel(
        a_desc, w_desc, y_ptr, offsets_ptr, scale_ptr, E, N, K, stride_ym,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, E_BLOCK: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, W_KN: gl.constexpr, HAS_SCALE: gl.constexpr,
        EPILOGUE: gl.constexpr, SWIGLU: gl.constexpr, SCOPE_CTA: gl.constexpr, LAG: gl.constexpr,
        WS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):  # fmt: skip
        """y[rows of e, cols] = epilogue(x[rows] @ W_e[:, cols]) * row_scale[rows]; with SWIGLU
        silu(x @ G_e) * (x @ U_e) * row_scale, w holding each expert's 2N gate-then-up columns (or rows).
        WS: warp-specialized on a persistent grid of clusters (one per pair of SMs that fits), the grid
        walking every pair tile, cluster c taking tiles c, c + grid, ... (its producer warp group keeps
        PRODUCER_REGS registers); else one cluster per pair tile, the lead refilling a slot LAG steps on."""
        if WS:
            NW: gl.constexpr = gl.num_warps()
            # each warp group of both CTAs frees a slot
            a_bufs, w_bufs, u_bufs, ready, lanes = _ring(a_desc, w_desc, STAGES, SWIGLU, NW, 2 * (NW // 4))
            # No cluster barrier here: the worker warps do not run this region (they wait for their
            # partition from the kernel's start), and a cluster barrier waits for every thread of both CTAs;
            # each partition takes part in the start and end barriers itself.
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (
                            y_ptr,
                            offsets_ptr,
                            scale_ptr,
                            a_bufs,
                            w_bufs,
                            u_bufs,
                            ready,
                            E,
                            N,
                            K,
                            stride_ym,
                            BLOCK_M,
                            BLOCK_N,
                            BLOCK_K,
                            E_BLOCK,
                            GROUP_M,
                            STAGES,
                            W_KN,
                            HAS_SCALE,
                            EPILOGUE,
                            SWIGLU,
                            NW,
                            SCOPE_CTA,
                        ),
                    ),
                    (
                        _ws_producer,
                        (
                            a_desc,
                            w_desc,
                            offsets_ptr,
                            a_bufs,
                            w_bufs,
                            u_bufs,
                            ready,
                            E,
                            N,
                            K,
                            BLOCK_M,
                            BLOCK_N,
                            BLOCK_K,
                            E_BLOCK,
                            GROUP_M,
                            STAGES,
                            W_KN,
                            SWIGLU,
                            SCOPE_CTA,
                        ),
                    ),
                ],
                [4],  # a whole warp group (setmaxnreg's unit); its first warp issues the copies
                [PRODUCER_REGS],
            )
        else:
            NW: gl.constexpr = gl.num_warps()
            PAIR: gl.constexpr = 2 * BLOCK_M
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0],
                warps_per_cta=[NW, 1],
                instr_shape=[16, BLOCK_N, 16],
                cga_layout=_bases(2, True),
            )
            # x: [PAIR, BLOCK_K] boxes, each CTA holding (and copying) its half; w: one box, multicast to
            # both; the empty barriers are waited on on the lead CTA, both CTAs arriving
            a_bufs, w_bufs, u_bufs, ready, lanes = _ring(a_desc, w_desc, STAGES, SWIGLU, NW, 2)
            XB: gl.constexpr = 8 * STAGES
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
                    up = gl.zeros([PAIR, BLOCK_N], gl.float32, acc_layout)
                # step i's wgmma runs while step i - 1's slot is handed back and refilled (one group in
                # flight)
                for i in range(steps):
                    s = i % STAGES
                    ph = (i // STAGES) & 1
                    mbarrier.wait(ready.index(s), ph)
                    acc = _wgmma(a_bufs.index(s), w_bufs.index(s), acc, W_KN)
                    if SWIGLU:
                        up = _wgmma(a_bufs.index(s), u_bufs.index(s), up, W_KN)
                        acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    if i > 0:  # step i - 1's wgmma is done in this warp group
                        gl.barrier()  # ... and in every warp group of this CTA ...
                        _empty_arrive(
                            lanes, 8 * ((i - 1) % STAGES) - XB, SCOPE_CTA
                        )  # ... which thread 0 tells
                    if i >= LAG:  # the lead (LAG 1: this step's arrivals; 2: the step before's)
                        p = (i - LAG) % STAGES
                        pph = ((i - LAG) // STAGES) & 1
                        nxt = i - LAG + STAGES
                        refill = nxt < steps
                        _empty_wait(lanes, 8 * p - XB, pph, refill.to(gl.int32), SCOPE_CTA)  # both CTAs have
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
                    acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if not SWIGLU:
                    up = acc
                _store_pair(
                    acc, up, y_ptr, scale_ptr, row0, row_end, col0, N, stride_ym, HAS_SCALE, EPILOGUE, SWIGLU
                )
            cluster.arrive()  # neither CTA exits while the other may still signal its barriers
            cluster.wait()
