"""Clustered Decompose-K: the S split programs of an output tile form one thread-block cluster and reduce
their fp32 partials through the cluster's distributed shared memory (Hopper, sm_90).

Grid: one cluster of S CTAs per output tile (``num_ctas=S``). CTA r of the cluster (its rank) computes the
fp32 partial of the tile over K split r: TMA copies of the A box [BLOCK_M, BLOCK_K] and the B box into a ring
of shared-memory slots (one mbarrier each), tensor-core MMAs (``mma.sync``; FMA for IEEE fp32) into registers.
Then the tile is reduced and scattered across the cluster:

1. push: the tile, flattened (``e = m * BLOCK_N + n``), is cut into S slices of SL elements; slice j belongs
   to CTA j. Each CTA writes every element of its partial into the owner's exchange area, row r (its rank):
   ``st.shared::cluster`` at the address ``mapa`` maps into CTA j's shared memory. Stores are fire and
   forget: no round trip.
2. one cluster barrier (``barrier.cluster.arrive`` with release semantics, ``wait`` with acquire): after it
   every CTA's exchange area holds all S rows of its slice.
3. each CTA sums its slice over the S rows in rank order (0, 1, ..., S-1: a fixed order, so the result is
   bitwise the same on every run), applies the epilogue and stores its slice of C.

A CTA may write into another's shared memory only once that CTA runs: every CTA arrives on the cluster
barrier (relaxed) when it starts and waits on it after its K loop, before its first remote store, so the
wait costs nothing in practice. No CTA touches another's shared memory after the second barrier, so a CTA
may exit as soon as it has stored its slice. No global workspace, no counters, no flags: a CUDA graph replays
the launch as is.

The exchange area lies past the shared memory Triton allocates for the kernel: the launch asks for
``align16(shared) + S * SL * 4`` bytes of dynamic shared memory and the kernel finds the area at
``global_smem + %dynamic_smem_size - S * SL * 4`` (Triton never touches bytes past its own allocation). Gluon
3.7.1 has no operation that reads another CTA's shared memory (a layout conversion or reduction across the
CTAs of a cluster fails to lower), so the cluster rank, the cluster id, the address mapping and the remote
stores are inline PTX.

N and K are compile-time constants (one compile per weight shape); M is a run-time value.

Where the clustered kernel cannot serve a call (a Triton without the Gluon features, a GPU other than
Hopper, operands TMA cannot read: strides or base not 16-byte aligned, neither dimension of b contiguous),
:func:`matmul` runs the library's default Decompose-K (:func:`moegemm.decompose_k.matmul`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .._runtime import INTERPRET
from ..epilogue import Epilogue

try:  # Gluon as Triton 3.7 spells it; a Triton without it (or with another API) gets the fallback
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import constexpr_function
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import cluster, fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_copy = tma.async_copy_global_to_shared
    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure means: no clustered kernel here
    gluon = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

MAX_CLUSTER = 16  # 8 is portable; 16 needs the non-portable attribute, which Triton's launcher sets
SMEM_BUDGET = 200 * 1024  # ring slots + exchange area per CTA (Hopper: 227 KiB per block)


def _gluon_api_ok() -> str | None:
    """None when the installed Triton has every Gluon feature the kernel uses, else what is missing."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    import inspect

    need = {
        "tma.async_copy_global_to_shared(multicast=)": "multicast"
        in inspect.signature(tma.async_copy_global_to_shared).parameters,
        "hopper.cluster.arrive/wait": hasattr(cluster, "arrive") and hasattr(cluster, "wait"),
        "gl.inline_asm_elementwise": hasattr(gl, "inline_asm_elementwise"),
        "gl.dot_fma": hasattr(gl, "dot_fma"),
        "gl.num_ctas": hasattr(gl, "num_ctas"),
        "BlockedLayout(cga_layout=)": "cga_layout" in {f.name for f in dataclasses.fields(gl.BlockedLayout)},
    }
    missing = [k for k, ok in need.items() if not ok]
    return None if not missing else "missing Gluon features: " + ", ".join(missing)


@functools.cache
def unsupported_reason(device_index: int | None = None) -> str | None:
    """Why the clustered kernel cannot run here (None: it can). ``device_index`` None checks the software
    only (what a CPU machine can check); else also that the GPU is a Hopper (compute capability 9.x)."""
    why = _gluon_api_ok()
    if why is not None:
        return why
    if INTERPRET:
        return "Gluon kernels have no interpreter (TRITON_INTERPRET=1)"
    if device_index is not None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        major, minor = torch.cuda.get_device_capability(device_index)
        if major != 9:
            return f"thread-block clusters with this kernel need Hopper (sm_90); device is sm_{major}{minor}"
    return None


def cluster_supported(device: torch.device | int | None = None) -> bool:
    """True when the clustered kernel can run: this Triton has the Gluon features it needs and (given a
    device) the GPU is a Hopper."""
    if isinstance(device, torch.device):
        device = (
            None
            if device.type != "cuda"
            else (device.index if device.index is not None else torch.cuda.current_device())
        )
    return unsupported_reason(device) is None


# ------------------------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------------------------

if gluon is not None:

    @constexpr_function
    def _bases(s, rank, rows):
        """CGA bases for a cluster of s CTAs: all zero (each CTA holds the whole tensor), or CTA r holding
        row r of dimension 0. Built in the kernel: lists are no constexpr arguments for Triton's launcher."""
        s, rank, rows = (getattr(v, "value", v) for v in (s, rank, rows))
        n = int(s).bit_length() - 1
        return [[(1 << i) if (rows and d == 0) else 0 for d in range(rank)] for i in range(n)]

    @gluon.jit
    def _sreg(layout: gl.constexpr, ASM: gl.constexpr):
        """A special register (``%cluster_ctarank``, ``%clusterid.x``) as an int32 scalar."""
        dummy = gl.full([32], 0, gl.int32, layout)
        v = gl.inline_asm_elementwise(ASM, "=r,r", [dummy], dtype=gl.int32, is_pure=True, pack=1)
        return gl.max(v, axis=0)

    @gluon.jit
    def _push(val, off, dst):
        """st.shared::cluster of each fp32 ``val`` at byte ``off`` of CTA ``dst``'s exchange area (offsets are
        negative: from the end of the dynamic shared memory)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .u32 %xa, %xd;
            mov.u32 %xa, global_smem;
            mov.u32 %xd, %dynamic_smem_size;
            add.u32 %xa, %xa, %xd;
            add.u32 %xa, %xa, $2;
            mapa.shared::cluster.u32 %xa, %xa, $3;
            st.shared::cluster.f32 [%xa], $1;
            mov.u32 $0, 0;
            }""",
            "=r,f,r,r",
            [val, off, dst],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _pull(off):
        """ld.shared of the fp32 at byte ``off`` of this CTA's exchange area (negative, from the end)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .u32 %xa, %xd;
            mov.u32 %xa, global_smem;
            mov.u32 %xd, %dynamic_smem_size;
            add.u32 %xa, %xa, %xd;
            add.u32 %xa, %xa, $1;
            ld.shared.f32 $0, [%xa];
            }""",
            "=f,r",
            [off],
            dtype=gl.float32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _mma_step(
        a_smem, b_smem, acc, B_KN: gl.constexpr, FMA: gl.constexpr, KW: gl.constexpr, PRECISION: gl.constexpr
    ):
        acc_layout: gl.constexpr = acc.type.layout
        if B_KN:
            b_view = b_smem
        else:
            b_view = b_smem.permute((1, 0))
        a = a_smem.load(gl.DotOperandLayout(0, acc_layout, KW))
        b = b_view.load(gl.DotOperandLayout(1, acc_layout, KW))
        if FMA:
            acc = gl.dot_fma(a, b, acc)
        else:
            acc = mma_v2(a, b, acc, input_precision=PRECISION)
        return acc

    @gluon.jit
    def _ws_produce(
        a_desc,
        b_desc,
        a_bufs,
        b_bufs,
        ready,
        empty,
        row0,
        col0,
        k0,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_K: gl.constexpr,
        B_KN: gl.constexpr,
        S: gl.constexpr,
    ):
        """The producer warp: every K step's two copies into its slot, the slot's ready barrier counting the
        bytes; in a ring, first the wait for the consumers to hand the slot back (a fresh barrier passes a
        wait on parity 1, so the first pass over the ring does not wait).

        A cluster barrier waits for every thread of the cluster that has not exited, and the worker warps
        do not run the code outside their function: they arrive on both of the exchange's cluster barriers
        there (the first, relaxed, at once, as the consumers did before the split; the second once the first
        has passed), so the consumers' waits pass. They never wait for the second: the consumers arrive on
        it only after the split has joined, which waits for these warps to return."""
        if S > 1:
            cluster.arrive(relaxed=True)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        for i in range(STEPS):
            s = i % STAGES
            if STEPS > STAGES:
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            _tma_copy(a_desc, [row0, k0 + i * BLOCK_K], ready.index(s), a_bufs.index(s))
            if B_KN:
                _tma_copy(b_desc, [k0 + i * BLOCK_K, col0], ready.index(s), b_bufs.index(s))
            else:
                _tma_copy(b_desc, [col0, k0 + i * BLOCK_K], ready.index(s), b_bufs.index(s))
        if S > 1:
            cluster.wait()
            cluster.arrive(relaxed=True)

    @gluon.jit
    def _ws_idle(S: gl.constexpr):
        """A worker warp that only arrives on the exchange's two cluster barriers (see :func:`_ws_produce`):
        Triton runs workers in whole warp groups, and a warp it added on its own would never arrive."""
        if S > 1:
            cluster.arrive(relaxed=True)
            cluster.wait()
            cluster.arrive(relaxed=True)

    @gluon.jit
    def _ws_consume(
        a_bufs,
        b_bufs,
        ready,
        empty,
        acc_layout: gl.constexpr,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        CHAINS: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        B_KN: gl.constexpr,
        FMA: gl.constexpr,
        KW: gl.constexpr,
        PRECISION: gl.constexpr,
    ):
        """The consumer warps: step i into chain i % CHAINS, a group of CHAINS steps waited for together; in a
        ring, the group's slots handed back once every consumer warp has read them. Returns the chains'
        sum (fixed order)."""
        acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc2 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc3 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        GROUPS: gl.constexpr = STEPS // CHAINS
        for j in range(GROUPS):
            base = (j * CHAINS) % STAGES
            phase = ((j * CHAINS) // STAGES) & 1
            for u in gl.static_range(CHAINS):
                mbarrier.wait(ready.index(base + u), phase)
            for u in gl.static_range(CHAINS):
                if u == 0:
                    acc0 = _mma_step(
                        a_bufs.index(base + u), b_bufs.index(base + u), acc0, B_KN, FMA, KW, PRECISION
                    )
                elif u == 1:
                    acc1 = _mma_step(
                        a_bufs.index(base + u), b_bufs.index(base + u), acc1, B_KN, FMA, KW, PRECISION
                    )
                elif u == 2:
                    acc2 = _mma_step(
                        a_bufs.index(base + u), b_bufs.index(base + u), acc2, B_KN, FMA, KW, PRECISION
                    )
                else:
                    acc3 = _mma_step(
                        a_bufs.index(base + u), b_bufs.index(base + u), acc3, B_KN, FMA, KW, PRECISION
                    )
            if STEPS > STAGES:
                gl.barrier()  # every consumer warp has read the group's slots
                for u in gl.static_range(CHAINS):
                    mbarrier.arrive(empty.index(base + u))
        for t in gl.static_range(GROUPS * CHAINS, STEPS):
            mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)
        for t in gl.static_range(GROUPS * CHAINS, STEPS):
            if t % CHAINS == 0:
                acc0 = _mma_step(
                    a_bufs.index(t % STAGES), b_bufs.index(t % STAGES), acc0, B_KN, FMA, KW, PRECISION
                )
            elif t % CHAINS == 1:
                acc1 = _mma_step(
                    a_bufs.index(t % STAGES), b_bufs.index(t % STAGES), acc1, B_KN, FMA, KW, PRECISION
                )
            else:
                acc2 = _mma_step(
                    a_bufs.index(t % STAGES), b_bufs.index(t % STAGES), acc2, B_KN, FMA, KW, PRECISION
                )
        acc = acc0
        if CHAINS > 1:
            acc = acc0 + acc1
        if CHAINS > 2:
            acc = acc + (acc2 + acc3)
        return acc

    @gluon.jit
    def _cluster_dk_kernel(
        a_desc,
        b_desc,
        c_ptr,
        bias_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        stride_cm,
        stride_cn,
        N: gl.constexpr,
        KPS: gl.constexpr,
        S: gl.constexpr,
        CG: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        CHAINS: gl.constexpr,
        PRODUCER: gl.constexpr,
        B_KN: gl.constexpr,
        FMA: gl.constexpr,
        KW: gl.constexpr,
        PRECISION: gl.constexpr,
        WARPS_M: gl.constexpr,
        WARPS_N: gl.constexpr,
        SL: gl.constexpr,
        SLP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        EPILOGUE: gl.constexpr,
    ):
        """C tile (cluster id) = epilogue(sum over the S CTAs of A[tile rows, split r] @ B[split r, cols])."""
        NW: gl.constexpr = WARPS_M * WARPS_N
        CGA: gl.constexpr = _bases(S, 2, False)  # every CTA holds the whole tensor (its own values)
        CGA1: gl.constexpr = _bases(S, 1, False)
        CGA_ROWS: gl.constexpr = _bases(S, 2, True)  # CTA r holds row r
        STEPS: gl.constexpr = KPS // BLOCK_K
        XBYTES: gl.constexpr = S * SL * 4  # this CTA's exchange area: S rows of SL fp32
        lin: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0], cga_layout=CGA1)
        if FMA:
            acc_layout: gl.constexpr = gl.BlockedLayout(
                [1, 1], [4, 8], [WARPS_M, WARPS_N], [1, 0], cga_layout=CGA
            )
        else:
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[2, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, 8], cga_layout=CGA
            )

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        # one barrier per slot in every CTA (a barrier layout whose CTA bases were zero would be one
        # barrier of the cluster's lead CTA, waited on by it alone)
        ready = mbarrier.allocate_mbarrier(batch=STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        if PRODUCER:  # slots handed back by the consumers (a ring only: else each slot is used once)
            empty = mbarrier.allocate_mbarrier(batch=STAGES)
            for i in gl.static_range(STAGES):
                mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        if S > 1:
            cluster.arrive(relaxed=True)  # "this CTA runs": waited on before the first remote store

        rank = _sreg(lin, "mov.u32 $0, %cluster_ctarank;")
        if S > 1:
            tile = _sreg(lin, "mov.u32 $0, %clusterid.x;")
        else:
            tile = gl.program_id(0)
        tiles_n: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        if CG > 1:  # CG clusters per tile, cluster g taking K splits g * S ... g * S + S - 1
            g = tile % CG
            tile = tile // CG
            k0 = (g * S + rank) * KPS
        else:
            k0 = rank * KPS
        row0 = (tile // tiles_n) * BLOCK_M
        col0 = (tile % tiles_n) * BLOCK_N
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes

        # prologue: fill every slot (boxes past K, M or N read zeros)
        for i in gl.static_range(STAGES):
            if i < STEPS and not PRODUCER:
                mbarrier.expect(ready.index(i), nbytes)
                _tma_copy(a_desc, [row0, k0 + i * BLOCK_K], ready.index(i), a_bufs.index(i))
                if B_KN:
                    _tma_copy(b_desc, [k0 + i * BLOCK_K, col0], ready.index(i), b_bufs.index(i))
                else:
                    _tma_copy(b_desc, [col0, k0 + i * BLOCK_K], ready.index(i), b_bufs.index(i))

        # CHAINS independent accumulators: step i adds into chain i % CHAINS, and the steps of a group are
        # waited for together, so their MMA chains interleave (one accumulator makes every MMA of the CTA
        # wait for the one before it); the chains are summed in a fixed order after the K loop
        acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc2 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc3 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if PRODUCER:  # one more warp issues every copy while these warps multiply
            acc = gl.warp_specialize(
                [
                    (
                        _ws_consume,
                        (
                            a_bufs,
                            b_bufs,
                            ready,
                            empty,
                            acc_layout,
                            STEPS,
                            STAGES,
                            CHAINS,
                            BLOCK_M,
                            BLOCK_N,
                            B_KN,
                            FMA,
                            KW,
                            PRECISION,
                        ),
                    ),
                    (
                        _ws_produce,
                        (
                            a_desc,
                            b_desc,
                            a_bufs,
                            b_bufs,
                            ready,
                            empty,
                            row0,
                            col0,
                            k0,
                            STEPS,
                            STAGES,
                            BLOCK_K,
                            B_KN,
                            S,
                        ),
                    ),
                    (_ws_idle, (S,)),
                    (_ws_idle, (S,)),
                    (_ws_idle, (S,)),
                ],
                [1, 1, 1, 1],
            )
        elif STEPS <= STAGES:  # every step has a slot of its own: no refills
            for g in gl.static_range(0, STEPS, CHAINS):
                for u in gl.static_range(CHAINS):
                    if g + u < STEPS:
                        mbarrier.wait(ready.index(g + u), 0)
                for u in gl.static_range(CHAINS):
                    if g + u < STEPS:
                        if u == 0:
                            acc0 = _mma_step(
                                a_bufs.index(g + u), b_bufs.index(g + u), acc0, B_KN, FMA, KW, PRECISION
                            )
                        elif u == 1:
                            acc1 = _mma_step(
                                a_bufs.index(g + u), b_bufs.index(g + u), acc1, B_KN, FMA, KW, PRECISION
                            )
                        elif u == 2:
                            acc2 = _mma_step(
                                a_bufs.index(g + u), b_bufs.index(g + u), acc2, B_KN, FMA, KW, PRECISION
                            )
                        else:
                            acc3 = _mma_step(
                                a_bufs.index(g + u), b_bufs.index(g + u), acc3, B_KN, FMA, KW, PRECISION
                            )
        else:  # a ring of STAGES slots (a multiple of CHAINS): one group of CHAINS slots per iteration
            GROUPS: gl.constexpr = STEPS // CHAINS
            for j in range(GROUPS):
                base = (j * CHAINS) % STAGES
                phase = ((j * CHAINS) // STAGES) & 1
                for u in gl.static_range(CHAINS):
                    mbarrier.wait(ready.index(base + u), phase)
                for u in gl.static_range(CHAINS):
                    if u == 0:
                        acc0 = _mma_step(
                            a_bufs.index(base + u), b_bufs.index(base + u), acc0, B_KN, FMA, KW, PRECISION
                        )
                    elif u == 1:
                        acc1 = _mma_step(
                            a_bufs.index(base + u), b_bufs.index(base + u), acc1, B_KN, FMA, KW, PRECISION
                        )
                    elif u == 2:
                        acc2 = _mma_step(
                            a_bufs.index(base + u), b_bufs.index(base + u), acc2, B_KN, FMA, KW, PRECISION
                        )
                    else:
                        acc3 = _mma_step(
                            a_bufs.index(base + u), b_bufs.index(base + u), acc3, B_KN, FMA, KW, PRECISION
                        )
                gl.barrier()  # every warp has read the group's slots before the copies into them are issued
                for u in gl.static_range(CHAINS):
                    nxt = j * CHAINS + u + STAGES
                    refill = nxt < STEPS
                    mbarrier.expect(ready.index(base + u), nbytes, pred=refill)
                    _tma_copy(
                        a_desc,
                        [row0, k0 + nxt * BLOCK_K],
                        ready.index(base + u),
                        a_bufs.index(base + u),
                        pred=refill,
                    )
                    if B_KN:
                        _tma_copy(
                            b_desc,
                            [k0 + nxt * BLOCK_K, col0],
                            ready.index(base + u),
                            b_bufs.index(base + u),
                            pred=refill,
                        )
                    else:
                        _tma_copy(
                            b_desc,
                            [col0, k0 + nxt * BLOCK_K],
                            ready.index(base + u),
                            b_bufs.index(base + u),
                            pred=refill,
                        )
            # the steps past the last whole group (fewer than CHAINS; their slots and phases are constants)
            for t in gl.static_range(GROUPS * CHAINS, STEPS):
                mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)
            for t in gl.static_range(GROUPS * CHAINS, STEPS):
                if t % CHAINS == 0:
                    acc0 = _mma_step(
                        a_bufs.index(t % STAGES), b_bufs.index(t % STAGES), acc0, B_KN, FMA, KW, PRECISION
                    )
                elif t % CHAINS == 1:
                    acc1 = _mma_step(
                        a_bufs.index(t % STAGES), b_bufs.index(t % STAGES), acc1, B_KN, FMA, KW, PRECISION
                    )
                else:
                    acc2 = _mma_step(
                        a_bufs.index(t % STAGES), b_bufs.index(t % STAGES), acc2, B_KN, FMA, KW, PRECISION
                    )
        if not PRODUCER:
            acc = acc0
            if CHAINS > 1:
                acc = acc0 + acc1
            if CHAINS > 2:
                acc = acc + (acc2 + acc3)

        # element e = m * BLOCK_N + n of the tile belongs to CTA e // SL, at column e % SL of its area
        # (rows of out2: CTA r holds row r; stores of a tensor whose layout has zero CTA bases are left to the
        # lead CTA alone)
        out2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0], cga_layout=CGA_ROWS)
        if S > 1:
            m = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout)), 1)
            n = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)), 0)
            e = m * BLOCK_N + n
            owner = e // SL
            off = (rank * SL + e % SL) * 4 - XBYTES
            cluster.wait()  # every CTA of the cluster runs
            _push(acc, off, owner)
            cluster.arrive()  # release: this CTA's remote stores ...
            cluster.wait()  # ... and every other's, acquired
            me = gl.expand_dims(gl.arange(0, S, layout=gl.SliceLayout(1, out2)), 1)  # = rank in CTA rank
            i = gl.expand_dims(gl.arange(0, SLP, layout=gl.SliceLayout(0, out2)), 0)
            ic = gl.where(i < SL, i, 0)  # lanes past the slice read a valid word; their store is masked
            total = gl.zeros([S, SLP], gl.float32, out2)
            for src in gl.static_range(S):  # rank order: the same sum on every run
                total += _pull((src * SL + ic) * 4 - XBYTES)
            e1 = me * SL + i
            inside = i < SL
            live = inside & (e1 < BLOCK_M * BLOCK_N)
            rows = row0 + e1 // BLOCK_N
            cols = col0 + e1 % BLOCK_N
        else:
            total = acc
            m = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout)), 1)
            n = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)), 0)
            e1 = m * BLOCK_N + n
            inside = e1 >= 0
            live = inside
            rows = row0 + m
            cols = col0 + n
        ok = live & (rows < M) & (cols < N)
        if CG > 1:
            # this cluster's sums of the tile into the workspace (row g of the tile's CG rows), then the
            # counter of (tile, rank); the CTA that counts last (of the CG holding this slice) sums the CG
            # rows in cluster order (the same sum whichever cluster ends last), stores, and sets the
            # counter back to zero for the next launch
            TE: gl.constexpr = S * SL
            base = ws_ptr + tile.to(gl.int64) * (CG * TE)
            gl.store(base + g * TE + e1, total, mask=inside)
            gl.barrier()  # every thread's store before the release below
            lane = gl.expand_dims(gl.arange(0, 32 * NW, layout=gl.SliceLayout(0, out2)), 0)
            mine = gl.expand_dims(gl.arange(0, S, layout=gl.SliceLayout(1, out2)), 1)  # = rank
            first = (lane == 0) & (mine >= 0)
            cnt = cnt_ptr + tile * S + mine + lane * 0
            old = gl.atomic_add(
                cnt, gl.full([S, 32 * NW], 1, gl.int32, out2), mask=first, sem="acq_rel", scope="gpu"
            )
            last = gl.expand_dims(gl.max(gl.where(first, old, -1), axis=1), 1) == CG - 1  # [S, 1]
            gl.store(cnt, gl.zeros([S, 32 * NW], gl.int32, out2), mask=first & last)
            if S == 1:
                last = gl.max(gl.max(gl.where(first, old, -1), axis=1), axis=0) == CG - 1
            total = gl.load(base + e1, mask=inside & last, other=0.0, cache_modifier=".cg")
            for q in gl.static_range(1, CG):
                total += gl.load(base + q * TE + e1, mask=inside & last, other=0.0, cache_modifier=".cg")
            ok = ok & last
        if HAS_BIAS:
            total = total + gl.load(bias_ptr + cols, mask=ok, other=0.0).to(gl.float32)
        if EPILOGUE == 1:  # NaN propagates, as in torch.relu
            total = gl.where(total < 0.0, 0.0, total)
        elif EPILOGUE == 2:
            total = 1.0 / (1.0 + gl.exp(-total))
        gl.store(c_ptr + rows * stride_cm + cols * stride_cn, total.to(c_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------------------
# Configs and the launch
# ------------------------------------------------------------------------------------------------------------

_GL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """split_k: S, the CTAs of a cluster (1, 2, 4, 8 or 16); block_m/block_n: the output tile (block_n 8:
    twice the tiles of 16, so twice the CTAs on a tiny output); block_k: the
    K step of one MMA (one TMA box; 16-bit: 64, fp32: 32 give 128-byte rows); num_warps; stages: ring slots
    (0: as many as the shared-memory budget allows, at most one per K step); chains: independent
    accumulators (1, 2 or 4), whose MMAs interleave: K step i adds into chain i % chains; producer: one more
    warp issues every TMA copy (warp-specialized) while the num_warps warps multiply, so no copy and no
    barrier it needs lies on their path; clusters: clusters per output tile (K split over S * clusters
    CTAs), each reducing through its shared memory, then the last to finish summing the clusters' partials
    from a workspace in cluster order."""

    split_k: int
    block_m: int = 16
    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4
    stages: int = 0
    chains: int = 1
    producer: bool = False
    clusters: int = 1

    def __post_init__(self) -> None:
        if self.split_k not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"config.split_k: expected 1, 2, 4, 8 or 16 (CTAs of a cluster), got {self.split_k!r}"
            )
        for name, lo, hi in (
            ("block_m", 16, 128),
            ("block_n", 8, 128),
            ("block_k", 16, 128),
            ("num_warps", 1, 8),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo or v > hi or v & (v - 1):
                raise ValueError(f"config.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")
        if not isinstance(self.stages, int) or self.stages < 0:
            raise ValueError(f"config.stages: expected an int >= 0, got {self.stages!r}")
        if not isinstance(self.producer, bool):
            raise TypeError(f"config.producer: expected a bool, got {self.producer!r}")
        if self.producer and self.num_warps % 4:
            raise ValueError(
                f"config.num_warps: a producer warp needs 4 or 8 multiplying warps, got {self.num_warps}"
            )
        if self.clusters not in (1, 2, 4, 8):
            raise ValueError(f"config.clusters: expected 1, 2, 4 or 8, got {self.clusters!r}")
        if self.chains not in (1, 2, 4):
            raise ValueError(f"config.chains: expected 1, 2 or 4, got {self.chains!r}")

    @classmethod
    def coerce(cls, config) -> ClusterConfig:
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            unknown = set(config) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"config: unknown keys {sorted(unknown)}")
            if "split_k" not in config:
                raise ValueError("config: missing key 'split_k'")
            return cls(**config)
        raise TypeError(f"config: expected ClusterConfig or dict, got {type(config).__name__}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


SMEM_PER_SM = 227 * 1024
GPC_SMS = 18  # SMs of a Hopper GPC at most: a cluster's CTAs share one GPC


def _estimate(m: int, n: int, k: int, esize: int, sm_count: int, cfg: ClusterConfig) -> float:
    """A relative time of the config: waves of clusters x K steps per CTA x the cost of one step.

    A CTA's K loop is bound by latency (a wait, the shared-memory loads and a chain of dependent MMAs per
    step), not by the bytes a step moves, so a step costs about one unit plus a share for its bytes; CTAs
    that share an SM overlap their latencies, so a wave is as many clusters as the GPU holds at once (by
    shared memory: all of a CTA's steps in flight where they fit; a 16-CTA cluster needs 16 SMs of one GPC,
    so only one fits in a GPC)."""
    steps = k_per_split(k, cfg) // cfg.block_k
    stage = _stage_bytes(cfg, esize)
    smem = stages_for(k, cfg, esize) * stage + exchange_bytes(cfg) + 1024
    per_sm = max(1, min(8, SMEM_PER_SM // smem))
    gpcs = max(1, sm_count // GPC_SMS)
    held = gpcs * (GPC_SMS * per_sm // cfg.split_k) if cfg.split_k > 1 else sm_count * per_sm
    clusters = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    waves = _cdiv(clusters, max(1, held))
    return waves * steps * (1.0 + stage / 8192)


def heuristic_config(m: int, n: int, k: int, dtype: torch.dtype, sm_count: int = 132) -> ClusterConfig:
    """The config with the least :func:`_estimate` among S = 16 or 8 (fewer where a split would be under
    two K steps) and tiles of 16, 32 or 64 rows and columns (8 columns where N <= 16), no larger than M and N
    need; ties go to the config that reads the fewest bytes (larger tiles re-read less of A and B). Four
    accumulator chains (two on tiles over 32 x 32), every K step in flight where shared memory holds them,
    a producer warp issuing the copies beside 4 multiplying warps (8 on 64 x 64 tiles)."""
    esize = torch.empty((), dtype=dtype).element_size()
    bk = 32 if dtype == torch.float32 else 64
    best = None
    for s in (16, 8, 4, 2, 1):
        if s > 1 and k < 2 * s * bk:
            continue
        for bm in (16, 32, 64):
            for bn in (8, 16, 32, 64):
                if (bm > 16 and bm // 2 >= m) or (bn > 16 and bn // 2 >= n) or (bn == 8 and n > 16):
                    continue
                cfg = ClusterConfig(
                    split_k=s,
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    num_warps=2 if bm * bn < 32 * 32 else 4,
                    chains=4 if bm * bn <= 32 * 32 else 2,
                    producer=False,
                )
                reads = _cdiv(m, bm) * _cdiv(n, bn) * (bm + bn)
                score = (_estimate(m, n, k, esize, sm_count, cfg), reads)
                if best is None or score < best[0]:
                    best = (score, cfg)
        if best is not None and s <= 8:
            break
    return best[1]


def _warps(cfg: ClusterConfig) -> tuple[int, int]:
    """(warps along M, along N) for the MMA layout: M first (16 rows per warp), the rest along N (8 columns
    per warp at least). A warp-specialized kernel keeps all num_warps (a multiple of 4): on a tile smaller
    than they cover, warps hold copies of the same values."""
    wm = min(cfg.num_warps, cfg.block_m // 16)
    wn = cfg.num_warps // wm
    while wn > 1 and wn * 8 > cfg.block_n and not cfg.producer:
        wn //= 2
    return wm, wn


def _slice(cfg: ClusterConfig) -> int:
    return _cdiv(cfg.block_m * cfg.block_n, cfg.split_k)


def exchange_bytes(cfg: ClusterConfig) -> int:
    return cfg.split_k * _slice(cfg) * 4 if cfg.split_k > 1 else 0


def k_per_split(k: int, cfg: ClusterConfig) -> int:
    """K per CTA: a whole number of BLOCK_K steps (the last split may be shorter, or empty: boxes past K read
    zeros)."""
    return _cdiv(_cdiv(k, cfg.split_k * cfg.clusters), cfg.block_k) * cfg.block_k


def _stage_bytes(cfg: ClusterConfig, esize: int) -> int:
    return (cfg.block_m + cfg.block_n) * cfg.block_k * esize


def stages_for(k: int, cfg: ClusterConfig, esize: int) -> int:
    """Ring slots: one per K step where they fit (every copy issued before the first MMA), else a multiple
    of ``chains`` (a group of chains steps refills its own slots)."""
    steps = k_per_split(k, cfg) // cfg.block_k
    if cfg.stages:
        want = cfg.stages
    else:
        want = (SMEM_BUDGET - exchange_bytes(cfg)) // _stage_bytes(cfg, esize)
    if want >= steps:
        return max(1, steps)
    return max(cfg.chains, want // cfg.chains * cfg.chains)


def _cga(s: int, rank: int) -> list:
    """Every CTA holds the whole tensor (its own values): log2(S) zero bases."""
    return [[0] * rank for _ in range(int(math.log2(s)))]


def _layouts(dtype, cfg: ClusterConfig, b_kn: bool):
    g = getattr(gl, _GL[dtype])
    la = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], g, cga_layout=_cga(cfg.split_k, 2))
    box_b = [cfg.block_k, cfg.block_n] if b_kn else [cfg.block_n, cfg.block_k]
    lb = gl.NVMMASharedLayout.get_default_for(box_b, g, cga_layout=_cga(cfg.split_k, 2))
    return la, lb, [cfg.block_m, cfg.block_k], box_b


def constexprs(
    n: int,
    k: int,
    dtype: torch.dtype,
    cfg: ClusterConfig,
    b_kn: bool,
    epilogue: Epilogue,
    has_bias: bool,
    allow_tf32: bool,
) -> dict:
    esize = torch.empty((), dtype=dtype).element_size()
    fma = dtype == torch.float32 and not allow_tf32
    wm, wn = _warps(cfg)
    sl = _slice(cfg)
    return {
        "N": n,
        "KPS": k_per_split(k, cfg),
        "S": cfg.split_k,
        "CG": cfg.clusters,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "STAGES": stages_for(k, cfg, esize),
        "CHAINS": cfg.chains,
        "PRODUCER": cfg.producer,
        "B_KN": b_kn,
        "FMA": fma,
        "KW": 0 if fma else (1 if dtype == torch.float32 else 2),
        "PRECISION": "ieee" if fma else "tf32",
        "WARPS_M": wm,
        "WARPS_N": wn,
        "SL": sl,
        "SLP": max(32, _pow2(sl)),
        "HAS_BIAS": has_bias,
        "EPILOGUE": int(epilogue),
    }


def compile_sm90(
    dtype: torch.dtype,
    n: int,
    k: int,
    cfg: ClusterConfig,
    *,
    b_kn: bool = True,
    epilogue: Epilogue = Epilogue.NONE,
    has_bias: bool = False,
    allow_tf32: bool = False,
):
    """The kernel compiled for sm_90a with the installed Triton, no GPU needed (raises where it does not
    compile); returns Triton's compiled kernel (``.asm["ptx"]``, ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    c = constexprs(n, k, dtype, cfg, b_kn, epilogue, has_bias, allow_tf32)
    la, lb, box_a, box_b = _layouts(dtype, cfg, b_kn)
    t = _SIG[dtype]
    sig = {
        "a_desc": f"tensordesc<{t}[{box_a[0]},{box_a[1]}],{la!r}>",
        "b_desc": f"tensordesc<{t}[{box_b[0]},{box_b[1]}],{lb!r}>",
        "c_ptr": f"*{t}",
        "bias_ptr": f"*{t}",
        "ws_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "M": "i32",
        "stride_cm": "i32",
        "stride_cn": "i32",
    }
    sig.update({name: "constexpr" for name in c})
    return triton.compile(
        GluonASTSource(fn=_cluster_dk_kernel, signature=sig, constexprs=c),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": c["WARPS_M"] * c["WARPS_N"], "num_ctas": cfg.split_k},
    )


def _tma_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[list, list, bool] | None:
    """(a's [shape, strides], b's [shape, strides] as TMA reads it, b_kn) or None where TMA cannot read the
    operands: a must be K-contiguous, b K- or N-contiguous, bases and row strides 16-byte aligned. A single
    row (or column) has no row stride to align: any aligned value serves, as TMA never steps past it."""
    esize = a.element_size()
    align = 16 // esize
    m, k = a.shape
    n = b.shape[1]
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return None
    if a.stride(1) != 1 and k > 1:
        return None
    sa = a.stride(0) if m > 1 else _cdiv(k, align) * align
    if sa % align:
        return None
    a_io = [[m, k], [sa, 1]]
    if b.stride(1) == 1 or n == 1:  # [K, N], N contiguous: boxes [BLOCK_K, BLOCK_N]
        sb = b.stride(0) if k > 1 else _cdiv(n, align) * align
        if sb % align == 0 and (b.stride(1) == 1 or n == 1):
            return a_io, [[k, n], [sb, 1]], True
    if b.stride(0) == 1 or k == 1:  # b = w.t() with w [N, K] row-major: boxes [BLOCK_N, BLOCK_K] of w
        sw = b.stride(1) if n > 1 else _cdiv(k, align) * align
        if sw % align == 0:
            return a_io, [[n, k], [sw, 1]], False
    return None


@dataclasses.dataclass(eq=False)
class ClusterPlan:
    """One (shapes, strides, dtypes, alignment, epilogue, config) compiled and bound:
    ``run(a, b, bias, out)``."""

    config: ClusterConfig
    epilogue: Epilogue
    m: int
    n: int
    k: int
    dtype: torch.dtype
    device: torch.device
    b_kn: bool
    a_geom: list
    b_geom: list
    boxes: tuple
    layouts: tuple
    grid: int
    shared: int  # dynamic shared memory per CTA: Triton's + the exchange area
    max_clusters: int  # clusters of this kernel the GPU holds at once (0: it cannot launch)
    ws: torch.Tensor = None  # clusters > 1: each tile's partial sums, one row per cluster (fp32)
    cnt: torch.Tensor = (
        None  # clusters > 1: per (tile, rank) the clusters done; back to zero after each launch
    )
    _run: object = None
    _function: object = None
    _packed: tuple = ()
    _tail: tuple = ()

    def descriptors(self, a: torch.Tensor, b: torch.Tensor):
        bt = b if self.b_kn else b.t()
        return (
            TensorDescriptor(a, self.a_geom[0], self.a_geom[1], list(self.boxes[0]), self.layouts[0]),
            TensorDescriptor(bt, self.b_geom[0], self.b_geom[1], list(self.boxes[1]), self.layouts[1]),
        )

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        from .._triton_common import raw_stream

        da, db = self.descriptors(a, b)
        self._run(
            self.grid,
            1,
            1,
            raw_stream(self.device.index),
            self._function,
            self._packed,
            None,
            None,
            None,
            da,
            db,
            out,
            out if bias is None else bias,
            self.ws,
            self.cnt,
            self.m,
            out.stride(0),
            out.stride(1),
            *self._tail,
        )
        return out


_PLANS: dict = {}
FALLBACK_REASONS: dict = {}  # (m, n, k, config) -> why a compiled kernel could not be launched here


def _key(a, b, bias, out, epilogue, config, allow_tf32):
    def geom(t):
        return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)

    return (geom(a), geom(b), geom(bias), geom(out), epilogue, config, allow_tf32)


def make_plan(
    a, b, *, epilogue: Epilogue = Epilogue.NONE, bias=None, out=None, config=None, allow_tf32: bool = False
) -> ClusterPlan | None:
    """The clustered kernel compiled for these operands (validated by the caller), or None where it cannot
    serve them here (see :func:`unsupported_reason`, :func:`_tma_operands`), or the GPU cannot hold one
    cluster of it."""
    if (
        a.device.type != "cuda"
        or unsupported_reason(a.device.index if a.device.index is not None else torch.cuda.current_device())
        is not None
    ):
        return None
    geo = _tma_operands(a, b)
    if geo is None or (bias is not None and bias.stride(0) != 1 and bias.shape[0] > 1):
        return None
    from .._runtime import device_sm_count

    m, k = a.shape
    n = b.shape[1]
    cfg = (
        ClusterConfig.coerce(config)
        if config is not None
        else heuristic_config(m, n, k, a.dtype, device_sm_count(a))
    )
    p, compiled = compile_for(a, b, geo, epilogue, bias, out, cfg, allow_tf32)
    compiled._init_handles()
    p.shared = _cdiv(int(compiled.metadata.shared), 16) * 16 + exchange_bytes(cfg)
    from triton.runtime import driver

    # sets the kernel's dynamic shared memory limit to what the launch asks (and allows 16-CTA clusters)
    try:
        p.max_clusters = int(
            driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, p.shared, cfg.split_k)
        )
    except RuntimeError as e:  # e.g. more shared memory than a block may have
        FALLBACK_REASONS[(m, n, k, cfg)] = f"occupancy query: {e}"
        return None
    if p.max_clusters < 1:
        FALLBACK_REASONS[(m, n, k, cfg)] = f"no cluster of {cfg.split_k} CTAs with {p.shared} B fits"
        return None
    p._run, p._function = compiled.run, compiled.function
    p._packed = (compiled.metadata.num_warps, compiled.metadata.num_ctas, p.shared)
    names = list(_cluster_dk_kernel.arg_names)
    c = constexprs(n, k, a.dtype, cfg, p.b_kn, epilogue, bias is not None, allow_tf32)
    p._tail = tuple(c[nm] for nm in names[names.index("stride_cn") + 1 :])
    return p


def compile_for(a, b, geo, epilogue, bias, out, cfg: ClusterConfig, allow_tf32: bool):
    """(the plan without its launch handles, the kernel compiled through Triton's launcher for exactly these
    arguments) - what a launch would compile; no launch."""
    a_io, b_io, b_kn = geo
    m, k = a.shape
    n = b.shape[1]
    c = constexprs(n, k, a.dtype, cfg, b_kn, epilogue, bias is not None, allow_tf32)
    la, lb, box_a, box_b = _layouts(a.dtype, cfg, b_kn)
    grid = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n) * cfg.clusters
    p = ClusterPlan(
        config=cfg,
        epilogue=epilogue,
        m=m,
        n=n,
        k=k,
        dtype=a.dtype,
        device=a.device,
        b_kn=b_kn,
        a_geom=a_io,
        b_geom=b_io,
        boxes=(tuple(box_a), tuple(box_b)),
        layouts=(la, lb),
        grid=grid,
        shared=0,
        max_clusters=0,
    )
    tiles = grid // cfg.clusters
    # the workspace and the counters (zero: each launch leaves them so) belong to the plan; a dummy word each
    # where the kernel has one cluster per tile
    p.ws = torch.empty(
        tiles * cfg.clusters * cfg.split_k * _slice(cfg) if cfg.clusters > 1 else 1,
        dtype=torch.float32,
        device=a.device,
    )
    p.cnt = torch.zeros(tiles * cfg.split_k if cfg.clusters > 1 else 1, dtype=torch.int32, device=a.device)
    probe = out if out is not None else torch.empty((m, n), dtype=a.dtype, device=a.device)
    da, db = p.descriptors(a, b)
    compiled = _cluster_dk_kernel.warmup(
        da,
        db,
        probe,
        bias if bias is not None else probe,
        p.ws,
        p.cnt,
        m,
        probe.stride(0),
        probe.stride(1),
        grid=(grid,),
        num_warps=c["WARPS_M"] * c["WARPS_N"],
        num_ctas=cfg.split_k,
        **c,
    )
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    return p, compiled


def plan(a, b, *, epilogue="none", bias=None, out=None, config=None, allow_tf32=False) -> ClusterPlan | None:
    """The cached clustered plan for these operands, or None where :func:`matmul` would fall back."""
    from .api import _validate

    epi = Epilogue.parse(epilogue)
    _validate(a, b, bias, out, None)
    if isinstance(config, dict):
        config = ClusterConfig.coerce(config)
    elif config is not None and not isinstance(config, ClusterConfig):
        raise TypeError(f"config: expected ClusterConfig or dict, got {type(config).__name__}")
    if config is not None and config.block_k * a.element_size() > 128:
        raise ValueError(
            f"config.block_k: a TMA box row holds at most 128 bytes (swizzled), so at most "
            f"{128 // a.element_size()} for {a.dtype}; got {config.block_k}"
        )
    key = _key(a, b, bias, out, epi, config, allow_tf32)
    if key in _PLANS:
        return _PLANS[key]
    m, k = a.shape
    n = b.shape[1]
    if config is not None and config.split_k > 1 and k < config.split_k:
        raise ValueError(f"config.split_k: expected 1 <= split_k <= K={k}, got {config.split_k}")
    if config is not None and config.clusters > 1 and k < config.split_k * config.clusters:
        raise ValueError(
            f"config.clusters: expected split_k * clusters <= K={k}, got {config.split_k} * {config.clusters}"
        )
    p = None
    if m > 0 and n > 0 and k > 0:
        p = make_plan(a, b, epilogue=epi, bias=bias, out=out, config=config, allow_tf32=allow_tf32)
    _PLANS[key] = p
    return p


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: str | Epilogue = "none",
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: ClusterConfig | dict | None = None,
    allow_tf32: bool = False,
) -> torch.Tensor:
    """``epilogue(a @ b + bias)`` by the clustered Decompose-K kernel (bitwise deterministic, CUDA-graph
    safe, no workspace). Same arguments and contract as :func:`moegemm.decompose_k.matmul`; where the
    clustered kernel cannot serve the call (see the module's docstring), that function serves it."""
    p = plan(a, b, epilogue=epilogue, bias=bias, out=out, config=config, allow_tf32=allow_tf32)
    if p is None:
        from .api import matmul as default_matmul

        return default_matmul(a, b, epilogue=epilogue, bias=bias, out=out, allow_tf32=allow_tf32)
    return p.run(a, b, bias, out)
