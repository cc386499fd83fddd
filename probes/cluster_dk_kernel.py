"""Clustered Decompose-K (a probe, not part of the library): the S split programs of an output tile form one
thread-block cluster and reduce their fp32 partials through the cluster's distributed shared memory (Hopper,
sm_90).

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
:func:`probes.cluster_dk.matmul` runs the library's default Decompose-K (:func:`moegemm.decompose_k.matmul`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moegemm._runtime import INTERPRET

try:  # Gluon as Triton 3.7 spells it; a Triton without it (or with another API) gets the fallback
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import constexpr_function
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import cluster, fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - the host's

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
    def _chain_step(
        a_bufs,
        b_bufs,
        slot,
        u: gl.constexpr,
        accs,
        B_KN: gl.constexpr,
        FMA: gl.constexpr,
        KW: gl.constexpr,
        PRECISION: gl.constexpr,
    ):
        """The K step in ring slot ``slot`` added into chain u's accumulator of ``accs`` (the four chains);
        the four returned, the others as they were."""
        acc0, acc1, acc2, acc3 = accs
        a_smem = a_bufs.index(slot)
        b_smem = b_bufs.index(slot)
        if u == 0:
            acc0 = _mma_step(a_smem, b_smem, acc0, B_KN, FMA, KW, PRECISION)
        elif u == 1:
            acc1 = _mma_step(a_smem, b_smem, acc1, B_KN, FMA, KW, PRECISION)
        elif u == 2:
            acc2 = _mma_step(a_smem, b_smem, acc2, B_KN, FMA, KW, PRECISION)
        else:
            acc3 = _mma_step(a_smem, b_smem, acc3, B_KN, FMA, KW, PRECISION)
        return acc0, acc1, acc2, acc3

    @gluon.jit
    def _cluster_dk_kernel(
        a_desc,
        b_desc,
        c_ptr,
        bias_ptr,
        M,
        stride_cm,
        stride_cn,
        N: gl.constexpr,
        KPS: gl.constexpr,
        S: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        CHAINS: gl.constexpr,
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
        fence_async_shared()
        if S > 1:
            cluster.arrive(relaxed=True)  # "this CTA runs": waited on before the first remote store

        rank = _sreg(lin, "mov.u32 $0, %cluster_ctarank;")
        if S > 1:
            tile = _sreg(lin, "mov.u32 $0, %clusterid.x;")
        else:
            tile = gl.program_id(0)
        tiles_n: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        k0 = rank * KPS
        row0 = (tile // tiles_n) * BLOCK_M
        col0 = (tile % tiles_n) * BLOCK_N
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes

        # prologue: fill every slot (boxes past K, M or N read zeros)
        for i in gl.static_range(STAGES):
            if i < STEPS:
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
        accs = (acc0, acc1, acc2, acc3)
        if STEPS <= STAGES:  # every step has a slot of its own: no refills
            for g in gl.static_range(0, STEPS, CHAINS):
                for u in gl.static_range(CHAINS):
                    if g + u < STEPS:
                        mbarrier.wait(ready.index(g + u), 0)
                for u in gl.static_range(CHAINS):
                    if g + u < STEPS:
                        accs = _chain_step(a_bufs, b_bufs, g + u, u, accs, B_KN, FMA, KW, PRECISION)
        else:  # a ring of STAGES slots (a multiple of CHAINS): one group of CHAINS slots per iteration
            GROUPS: gl.constexpr = STEPS // CHAINS
            for j in range(GROUPS):
                base = (j * CHAINS) % STAGES
                phase = ((j * CHAINS) // STAGES) & 1
                for u in gl.static_range(CHAINS):
                    mbarrier.wait(ready.index(base + u), phase)
                for u in gl.static_range(CHAINS):
                    accs = _chain_step(a_bufs, b_bufs, base + u, u, accs, B_KN, FMA, KW, PRECISION)
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
                accs = _chain_step(a_bufs, b_bufs, t % STAGES, t % CHAINS, accs, B_KN, FMA, KW, PRECISION)
        acc0, acc1, acc2, acc3 = accs
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
        if HAS_BIAS:
            total = total + gl.load(bias_ptr + cols, mask=ok, other=0.0).to(gl.float32)
        if EPILOGUE == 1:  # NaN propagates, as in torch.relu
            total = gl.where(total < 0.0, 0.0, total)
        elif EPILOGUE == 2:
            total = 1.0 / (1.0 + gl.exp(-total))
        gl.store(c_ptr + rows * stride_cm + cols * stride_cn, total.to(c_ptr.dtype.element_ty), mask=ok)
