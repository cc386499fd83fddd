"""Stand-ins the FP8 experiment's tests share (tests/test_e10.py): a vLLM-like source tree of our own (its
fused_moe_kernel and _per_token_group_quant_fp8 with vLLM's signatures, written here, computing what their
arguments say), a stand-in of DeepGEMM's grouped FP8 functions, and small random projection and FFN cells."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from conftest import DEVICE
from experiments import fp8_peers, fp8_refs, vllm_fp8
from experiments.fp8_cells import GemmCell, Weights
from experiments.harness.correctness import check_bounded
from moegemm.grouped import permute, route

SMALL = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4}
# A fused_moe-like source of our own: a kernel with vLLM's arguments (every one the contender passes) that
# computes the block-FP8 product as the argument names say, its helper, and vLLM-style imports left out
SYNTHETIC_MOE = textwrap.dedent("""
    import vllm.envs as envs
    from vllm.triton_utils import tl, triton


    @triton.jit
    def write_zeros_to_output(c_ptr, N):
        pass


    @triton.jit
    def fused_moe_kernel(a_ptr, b_ptr, c_ptr, b_bias_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
                         sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, N, K, EM,
                         num_valid_tokens, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm,
                         stride_cn, stride_asm, stride_ask, stride_bse, stride_bsk, stride_bsn,
                         group_n: tl.constexpr, group_k: tl.constexpr, naive_block_assignment: tl.constexpr,
                         BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                         GROUP_SIZE_M: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, top_k: tl.constexpr,
                         compute_type: tl.constexpr, use_fp8_w8a8: tl.constexpr, SWAP_AB: tl.constexpr):
        tiles_n = tl.cdiv(N, BLOCK_SIZE_N)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
            return
        offs = tl.arange(0, BLOCK_SIZE_M)
        if naive_block_assignment:
            rows = tl.where(offs == 0, pid_m, num_valid_tokens)
        else:
            rows = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_SIZE_M + offs)
        live = rows < num_valid_tokens
        src = tl.where(live, rows // top_k, 0)
        ex = tl.load(expert_ids_ptr + pid_m)
        cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        cok = cols < N
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            kk = kb * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
            kok = kk < K
            a = tl.load(a_ptr + src[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=live[:, None] & kok[None, :], other=0.0)
            b = tl.load(b_ptr + ex * stride_be + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=kok[:, None] & cok[None, :], other=0.0)
            ks = kb * BLOCK_SIZE_K // group_k
            sa = tl.load(a_scale_ptr + src * stride_asm + ks * stride_ask, mask=live, other=0.0)
            sb = tl.load(b_scale_ptr + ex * stride_bse + (cols // group_n) * stride_bsn + ks * stride_bsk,
                         mask=cok, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        if MUL_ROUTED_WEIGHT:
            acc = acc * tl.load(topk_weights_ptr + rows, mask=live, other=0.0)[:, None]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(compute_type),
                 mask=live[:, None] & cok[None, :])


    def get_default_config(M, E, N, K, topk, dtype, block_shape=None):
        if envs.VLLM_BATCH_INVARIANT or current_platform.is_rocm():
            return {}
        fp8 = dtype == "fp8_w8a8" and block_shape == [128, 128]
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128 if fp8 else 64, "BLOCK_SIZE_K": 128,
                "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}
""")
# ... and an fp8_utils-like source: a per-token, 128-channel quantisation kernel with vLLM's signature
SYNTHETIC_FP8_UTILS = textwrap.dedent("""
    from vllm.triton_utils import tl, triton


    @triton.jit
    def _per_token_group_quant_fp8(y_ptr, y_q_ptr, y_s_ptr, group_size, y_num_columns, y_row_stride, eps,
                                   fp8_min: tl.constexpr, fp8_max: tl.constexpr, use_ue8m0: tl.constexpr,
                                   BLOCK: tl.constexpr):
        g = tl.program_id(0)
        per_row = y_num_columns // group_size
        cols = tl.arange(0, BLOCK)
        ok = cols < group_size
        v = tl.load(y_ptr + (g // per_row) * y_row_stride + (g % per_row) * group_size + cols, mask=ok,
                    other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(v)), eps) / fp8_max
        q = tl.clamp(v / s, fp8_min, fp8_max)
        tl.store(y_q_ptr + g * group_size + cols, q.to(y_q_ptr.dtype.element_ty), mask=ok)
        tl.store(y_s_ptr + g, s)
""")


def synthetic_vllm(root: Path, fp8_utils: bool = True) -> Path:
    """An unpacked vLLM-like tree: fused_moe.py, and fp8_utils.py beside it where asked."""
    moe = root / "vllm" / "model_executor" / "layers" / "fused_moe" / "fused_moe.py"
    moe.parent.mkdir(parents=True)
    moe.write_text(SYNTHETIC_MOE)
    if fp8_utils:
        utils = root / "vllm" / "model_executor" / "layers" / "quantization" / "utils" / "fp8_utils.py"
        utils.parent.mkdir(parents=True)
        utils.write_text(SYNTHETIC_FP8_UTILS)
    return moe


def small_cell(proj: str, seed: int = 0, e: int = 4, t: int = 5, k: int = 256, n: int = 192, top_k: int = 2):
    """A small projection cell (some experts get no row; K and N not multiples of 128 where asked) and its
    bf16 weights [E, N, K], with the bf16 rows' float64 reference."""
    from experiments.e7_grouped_skew import ref_rows

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:top_k] for _ in range(t)]).to(DEVICE)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(DEVICE)
    x[0, 3] = 40.0  # an outlier: its 128-channel block quantises the others coarsely
    w = (torch.randn(e, n, k, generator=g) / k**0.5).to(torch.bfloat16).to(DEVICE)
    plan = route(ids, e)
    xs = permute(x, plan)
    cell = GemmCell(x, ids, plan, xs, n, proj, decode=True)
    return cell, Weights([w]), ref_rows(xs, w, plan.group_offsets)


def ffn_case(seed: int = 1, e: int = 4, top_k: int = 2, t: int = 6, h: int = 256, i: int = 128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(DEVICE)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEVICE)
    wts = torch.softmax(torch.randn(t, top_k, generator=g), -1).to(DEVICE)
    gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16).to(DEVICE)
    dn = (torch.randn(e, h, i, generator=g) / i**0.5).to(torch.bfloat16).to(DEVICE)
    q = (*fp8_refs.quantize_weights(gu, "block"), *fp8_refs.quantize_weights(dn, "block"))
    ref = fp8_refs.ffn_reference(
        x,
        ids,
        wts,
        lambda ex: fp8_refs.weights64("block", q[0], q[1], ex),
        lambda ex: fp8_refs.weights64("block", q[2], q[3], ex),
    )
    return x, ids, wts, e, q, ref


def vllm_checks(vk, qk):
    """vLLM's block-FP8 kernel on both projections (the naive assignment where a cell has few slots), and its
    whole layer, each through E10's check."""
    peers = fp8_peers.Peers(vllm=(vk, qk))
    choice = {"config": SMALL, "source": "test", "tried": 1, "own": None}
    for proj, e in (("up", 4), ("down", 4), ("up", 32)):
        cell, w, _ = small_cell(proj, e=e, t=3 if e == 32 else 5)
        c = fp8_peers.vllm_contender(cell, w, peers, choice)
        assert c.fields["naive_block_assignment"] == (e == 32)
        ok, rel, why = c.check(c.bind((0,))())
        assert ok, (proj, e, why)
    x, ids, wts, e, q, (ref, bound) = ffn_case()
    y = vllm_fp8.layer(vk, qk, x, ids, wts, e, SMALL)(*q)()
    ok, rel, why = check_bounded(y, ref, bound, fp8_refs.rel_budget(2))
    assert ok, why


class DeepGemmStandIn:
    """DeepGEMM's grouped FP8 functions with the arguments and layouts its sm_90 path takes (the float32
    scales' default recipe: activations one per row and 128 channels, MN-major and TMA-aligned; weights one
    per 128 x 128 block, contiguous), each asserting them and computing the product in float64 (bf16 out):
    the contender's plumbing without a GPU. Its masked function also asserts m_max a multiple of 128, the
    largest row tile the masked kernel stores whole on sm_90."""

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return 128

    @staticmethod
    def get_mn_major_tma_aligned_tensor(s: torch.Tensor) -> torch.Tensor:
        mn, kb = s.shape[-2:]
        buf = torch.empty(*s.shape[:-2], kb, -(-mn // 4) * 4, dtype=s.dtype, device=s.device)
        out = buf[..., :mn].transpose(-1, -2)
        out.copy_(s)
        return out

    @staticmethod
    def _operands(a, sfa, w, ws, d, m):
        e, n, k = w.shape
        kb = -(-k // 128)
        assert a.dtype == w.dtype == fp8_refs.FP8 and a.is_contiguous() and w.is_contiguous()
        assert sfa.dtype == ws.dtype == torch.float32 and sfa.shape[-2:] == (m, kb)
        assert sfa.stride(-2) == 1 and sfa.stride(-1) == -(-m // 4) * 4, "sfa: MN-major, TMA-aligned"
        assert tuple(ws.shape) == (e, -(-n // 128), kb) and ws.is_contiguous()
        assert d.dtype == torch.bfloat16 and d.is_contiguous() and d.shape[-1] == n
        return e, lambda ex: fp8_refs.weights64("block", w, ws, ex)

    def m_grouped_fp8_gemm_nt_contiguous(self, a_pair, b_pair, d, layout):
        (a, sfa), (w, ws) = a_pair, b_pair
        m = a.shape[0]
        e, w64 = self._operands(a, sfa, w, ws, d, m)
        assert layout.dtype == torch.int32 and layout.is_contiguous() and tuple(layout.shape) == (m,)
        assert m % self.get_mk_alignment_for_contiguous_layout() == 0
        x64 = fp8_refs.rows64("block", a, sfa.contiguous())
        for ex in range(e):
            rows = layout == ex
            if rows.any():
                d[rows] = (x64[rows] @ w64(ex).T).to(d.dtype)

    def m_grouped_fp8_gemm_nt_masked(self, a_pair, b_pair, d, masked_m, expected_m):
        (a, sfa), (w, ws) = a_pair, b_pair
        ex_, m_max, _ = a.shape
        e, w64 = self._operands(a, sfa, w, ws, d, m_max)
        assert ex_ == e and tuple(d.shape[:2]) == (e, m_max) and m_max % 128 == 0
        assert masked_m.dtype == torch.int32 and tuple(masked_m.shape) == (e,) and expected_m > 0
        for ex, rows in enumerate(masked_m.tolist()):
            x64 = fp8_refs.rows64("block", a[ex, :rows], sfa[ex, :rows].contiguous())
            d[ex, :rows] = (x64 @ w64(ex).T).to(d.dtype)
