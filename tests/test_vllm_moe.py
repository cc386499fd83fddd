"""experiments/vllm_moe.py: vLLM's fused-MoE kernel as an optional E7 contender. Without vLLM's source (CI)
the loader, the row-id lists and the config choice are tested on stand-ins; with MOEGEMM_VLLM_SOURCE set
(a vLLM wheel or its fused_moe.py) its real kernel also runs under the interpreter against float64."""

from __future__ import annotations

import json
import os
import textwrap
import zipfile

import pytest
import torch

from conftest import DEVICE
from experiments import vllm_moe as vm
from moegemm.grouped import permute, route

# a stand-in fused_moe.py: a kernel with every argument the contender passes, the helper it must find,
# a function that is not extracted (it would need vLLM), and vLLM-style imports the extraction leaves out
STAND_IN = textwrap.dedent("""
    import vllm.envs as envs
    from vllm.triton_utils import tl, triton


    @triton.jit
    def write_zeros_to_output(c_ptr, N):
        pass


    def not_a_kernel():
        return envs.SOMETHING


    @triton.jit
    def fused_moe_kernel(a_ptr, b_ptr, c_ptr, b_bias_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
                         sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, N, K, EM,
                         num_valid_tokens, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm,
                         stride_cn, naive_block_assignment: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                         BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
                         MUL_ROUTED_WEIGHT: tl.constexpr, top_k: tl.constexpr, compute_type: tl.constexpr):
        write_zeros_to_output(c_ptr, N)


    def get_default_config(M, E, N, K, topk, dtype, block_shape=None):
        if envs.VLLM_BATCH_INVARIANT or current_platform.is_rocm():
            return {"BLOCK_SIZE_M": 1}
        return {"BLOCK_SIZE_M": next_power_of_2(M), "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
""")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEGEMM_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_load_reads_kernel_helper_and_default_config_from_a_file(cache):
    src = cache / "fused_moe.py"
    src.write_text(STAND_IN)
    (cache / "configs").mkdir()
    (cache / "configs" / "E=8,N=64,device_name=NVIDIA_H200.json").write_text(
        json.dumps({"triton_version": "3.5", "1": {"BLOCK_SIZE_M": 16}, "64": {"BLOCK_SIZE_M": 64}})
    )
    vk = vm.load(src)
    assert vk.kernel.arg_names[:3] == ["a_ptr", "b_ptr", "c_ptr"]
    assert vk.origin.startswith("fused_moe.py sha256:")
    text = next((cache / "cache").glob("vllm_fused_moe_*.py")).read_text()
    assert "def write_zeros_to_output" in text and "def fused_moe_kernel" in text
    assert "not_a_kernel" not in text and "import vllm" not in text
    # its tuned table: the entry nearest the token count; elsewhere its default config
    assert vm.own_choice(vk, "NVIDIA H200", 8, 64, 32, 128, 2, 40) == (
        {"BLOCK_SIZE_M": 64},
        "vllm-table(E=8,N=64,M=64)",
    )
    assert vm.own_choice(vk, "NVIDIA H200", 8, 64, 32, 128, 2, 20)[1] == "vllm-table(E=8,N=64,M=1)"
    cfg, source = vm.own_choice(vk, "NVIDIA H100 80GB HBM3", 8, 64, 32, 128, 2, 20)
    assert source == "vllm-default" and cfg["BLOCK_SIZE_M"] == 32  # next_power_of_2(20), not the ROCm branch


def test_load_names_the_unpacked_tree_version(cache):
    tree = cache / "unpacked" / "vllm"
    mod = tree / "model_executor" / "layers" / "fused_moe"
    mod.mkdir(parents=True)
    (mod / "fused_moe.py").write_text(STAND_IN)
    assert vm.load(mod / "fused_moe.py").origin.startswith(
        "fused_moe.py sha256:"
    )  # no _version.py: no version
    (tree / "_version.py").write_text("version: str\n__version__ = version = '9.8.7'\n")
    assert vm.load(mod / "fused_moe.py").origin.startswith("vllm 9.8.7 fused_moe.py sha256:")


def test_load_reads_a_wheel(cache):
    whl = cache / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(vm.MODULE, STAND_IN)
        z.writestr(
            vm.CONFIGS + "E=4,N=32,device_name=NVIDIA_H200.json", json.dumps({"8": {"BLOCK_SIZE_M": 16}})
        )
        z.writestr(vm.CONFIGS + "README", "not a table")
    vk = vm.load(whl)
    assert vk.origin == whl.name and list(vk.configs) == ["E=4,N=32,device_name=NVIDIA_H200.json"]


def test_load_refuses_bad_sources(cache):
    with pytest.raises(FileNotFoundError, match="MOEGEMM_VLLM_SOURCE"):
        vm.load(cache / "missing.py")
    no_helper = cache / "a.py"
    no_helper.write_text(STAND_IN.replace("def write_zeros_to_output", "def something_else"))
    with pytest.raises(ValueError, match="write_zeros_to_output"):
        vm.load(no_helper)
    old = cache / "b.py"
    old.write_text(STAND_IN.replace("naive_block_assignment: tl.constexpr, ", ""))
    with pytest.raises(ValueError, match="naive_block_assignment"):
        vm.load(old)
    whl = cache / "vllm-x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm/other.py", "")
    with pytest.raises(ValueError, match="holds no"):
        vm.load(whl)


def test_no_vllm_and_no_source_is_none(monkeypatch):
    pytest.importorskip("triton")
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    monkeypatch.delenv("MOEGEMM_VLLM_SOURCE", raising=False)
    assert vm.load() is None


def test_device_file_name():
    assert vm.device_file_name("NVIDIA H200") == "NVIDIA_H200"
    assert vm.device_file_name("NVIDIA H200 NVL") == "NVIDIA_H200"
    assert vm.device_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_groups_each_expert_padded_to_the_tile(seed, block_m):
    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(1, 12, (1,), generator=g))
    k = int(torch.randint(1, e + 1, (1,), generator=g))
    t = int(torch.randint(1, 20, (1,), generator=g))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if seed == 0:  # every token on the same experts: the rest hold none
        ids = torch.arange(k).repeat(t, 1)
    plan = route(ids, e)
    rows, tile_expert, post = vm.align(plan, block_m)
    slots = t * k
    length = slots + e * (block_m - 1)
    assert rows.numel() == (min(length, slots * block_m) if slots < e else length)
    sizes = plan.group_sizes.tolist()
    pos = 0
    for ex in range(e):  # expert ex: its slots in the plan's order, then fillers to a whole tile
        lo, hi = plan.group_offsets[ex].item(), plan.group_offsets[ex + 1].item()
        padded = -(-sizes[ex] // block_m) * block_m
        assert rows[pos : pos + sizes[ex]].tolist() == plan.sorted_slot[lo:hi].tolist()
        assert (rows[pos + sizes[ex] : pos + padded] == slots).all()
        assert (tile_expert[pos // block_m : (pos + padded) // block_m] == ex).all()
        pos += padded
    assert post.tolist() == [pos] and (rows[pos:] == slots).all()
    assert tile_expert.numel() == -(-rows.numel() // block_m)


def test_launcher_refuses_unknown_config_keys(cache):
    src = cache / "fused_moe.py"
    src.write_text(STAND_IN)
    vk = vm.load(src)
    plan = route(torch.tensor([[0], [1]]), 2)
    with pytest.raises(ValueError, match="kpack"):
        vm.launcher(
            vk,
            torch.ones(2, 16),
            1,
            plan,
            torch.tensor([[0], [1]]),
            16,
            {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 1, "kpack": 2},
            False,
        )


def test_candidates_fit_shared_memory_and_cover_the_regimes():
    for rows in (0.5, 8, 40, 512):
        cs = vm.candidates(rows)
        assert cs and all(
            (c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_K"] + c["BLOCK_SIZE_K"] * c["BLOCK_SIZE_N"])
            * 2
            * c["num_stages"]
            <= 200 * 1024
            for c in cs
        )
    assert {c["BLOCK_SIZE_M"] for c in vm.candidates(8)} == {16}
    assert max(c["BLOCK_SIZE_M"] for c in vm.candidates(512)) == 128


@pytest.mark.skipif(
    not os.environ.get("MOEGEMM_VLLM_SOURCE"), reason="needs MOEGEMM_VLLM_SOURCE (vLLM's source)"
)
@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("proj", ["up", "down"])
@pytest.mark.parametrize("seed", range(3))
def test_real_kernel_matches_float64(cache, seed, proj, naive):
    """vLLM's kernel through this contender's row-id lists (fp32 operands: the interpreter's bf16 dot is
    wrong; a GPU's takes tf32), output poisoned with NaN first, in slot order against the float64 per-expert
    reference."""
    vk = vm.load(os.environ["MOEGEMM_VLLM_SOURCE"])
    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(2, 9, (1,), generator=g))
    k = int(torch.randint(1, e + 1, (1,), generator=g))
    t = int(torch.randint(1, 12, (1,), generator=g))
    kk, n = int(torch.randint(8, 70, (1,), generator=g)), int(torch.randint(8, 70, (1,), generator=g))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    plan = route(ids, e)
    x = torch.randn(t, kk, generator=g).to(DEVICE)
    w = torch.randn(e, n, kk, generator=g).to(DEVICE)
    xs = permute(x, plan)
    ref = torch.empty(t * k, n, dtype=torch.float64)
    off = plan.group_offsets.tolist()
    for ex in range(e):
        ref[off[ex] : off[ex + 1]] = xs[off[ex] : off[ex + 1]].double().cpu() @ w[ex].double().cpu().T
    if proj == "up":
        a, tk = x, k
    else:
        a, tk = torch.empty_like(xs), 1
        a[plan.sorted_slot.long()] = xs
    cfg = {
        "BLOCK_SIZE_M": 16,
        "BLOCK_SIZE_N": 32,
        "BLOCK_SIZE_K": 16,
        "GROUP_SIZE_M": 1,
        "num_warps": 4,
        "num_stages": 2,
    }
    call = vm.launcher(vk, a, tk, plan, ids, n, cfg, naive)(w)
    y = call()
    y.fill_(float("nan"))
    y = call()
    got = y[plan.sorted_slot.long()].double().cpu()
    assert not got.isnan().any()
    tol = 1e-4 if DEVICE == "cpu" else 2e-2  # on a GPU its fp32 dot takes tf32
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_e7_leaves_an_unfit_installed_vllm_out_but_not_a_named_source(cache, monkeypatch):
    from experiments import e7_grouped_skew as e7

    monkeypatch.delenv("MOEGEMM_VLLM_SOURCE", raising=False)

    def unfit(source=None):
        raise ValueError("its fused_moe_kernel has no argument(s) top_k")

    monkeypatch.setattr(vm, "load", unfit)
    vk, why = e7.load_vllm()
    assert vk is None and why == "left out: its fused_moe_kernel has no argument(s) top_k"
    monkeypatch.setenv("MOEGEMM_VLLM_SOURCE", str(cache / "fused_moe.py"))
    with pytest.raises(ValueError, match="top_k"):
        e7.load_vllm()


def test_e7_records_a_failed_vllm_search_as_an_error():
    from experiments import e7_grouped_skew as e7

    c = e7.failed_contender("vllm:fused_moe", "config search failed: RuntimeError: no config right")
    call = c.bind(("xs", "w"))  # binding does not raise (measure binds before its try)
    with pytest.raises(RuntimeError, match="config search failed"):
        call()


def test_e7_vllm_loads_once_and_searches_once_per_model_projection_and_tokens(monkeypatch):
    """E7's and the power probe's vLLM contender (e7.Vllm): vLLM loaded once; no kernel at hand, no
    contender; the config search run once per (model, projection, T) whatever the load, and a failed one
    turned into an error contender for each of that triple's cells."""
    from experiments import e7_grouped_skew as e7

    loads, searches = [], []
    monkeypatch.setattr(e7, "load_vllm", lambda: (loads.append(1), (None, "not available"))[1])
    v = e7.Vllm()
    g = {"models": {"m": {"top_k": 2}}}
    assert v.contender(g, ("m", "up", 64, "uniform"), *[None] * 7, 16, 32) is None
    v.load()
    assert loads == [1]

    def failing(*args):
        searches.append(args[1:5])
        raise RuntimeError("no config right")

    monkeypatch.setattr(e7, "vllm_search", failing)
    v = e7.Vllm()
    v.kernel, v.loaded = object(), True
    cs = [v.contender(g, ("m", "up", 64, load), *[None] * 7, 16, 32) for load in ("uniform", "zipf1.2")]
    assert len(searches) == 1 and searches[0][1:] == ("m", "up", 64)
    for c in cs:
        assert c.name == "vllm:fused_moe"
        with pytest.raises(RuntimeError, match="config search failed: RuntimeError: no config right"):
            c.bind(("xs", "w"))()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_triton_matches_the_torch_lists_up_to_order_within_an_expert(seed, block_m):
    """The Triton stand-in for vLLM's moe_align_block_size: each expert's padded list holds exactly its
    slots (any order) then fillers; the tile experts and the padded total as the torch lists; run twice on
    buffers poisoned in between (they are reused per call)."""
    g = torch.Generator().manual_seed(100 + seed)
    e = int(torch.randint(1, 12, (1,), generator=g))
    k = int(torch.randint(1, e + 1, (1,), generator=g))
    t = int(torch.randint(1, 30, (1,), generator=g))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    plan = route(ids, e)
    want_rows, want_tiles, want_post = vm.align(plan, block_m)
    al = vm.AlignTriton(t * k, e, block_m, DEVICE)
    al(ids.to(torch.int32))
    for buf in (al.ids, al.expert_ids, al.post, al.offs, al.cursor):
        buf.fill_(-7)
    rows, tiles, post = al(ids.to(torch.int32))
    assert post.tolist() == want_post.tolist()
    assert rows.numel() == want_rows.numel() and tiles.numel() == want_tiles.numel()
    n_tiles = int(post) // block_m
    assert tiles[:n_tiles].tolist() == want_tiles[:n_tiles].tolist()
    assert ((tiles >= 0) & (tiles < e)).all()
    for ex in range(e):  # per expert: the same set of slots
        lo, hi = plan.group_offsets[ex].item(), plan.group_offsets[ex + 1].item()
        start = int((want_tiles[:n_tiles] < ex).sum()) * block_m
        padded = -(-(hi - lo) // block_m) * block_m
        got = rows[start : start + padded].tolist()
        assert sorted(v for v in got if v != t * k) == sorted(plan.sorted_slot[lo:hi].tolist())
        assert got.count(t * k) == padded - (hi - lo)
    assert (rows[int(post) :] == t * k).all()


def test_align_triton_refuses_bad_sizes():
    with pytest.raises(ValueError, match="slots"):
        vm.AlignTriton(0, 4, 16, DEVICE)
    al = vm.AlignTriton(6, 4, 16, DEVICE)
    with pytest.raises(ValueError, match="topk_ids"):
        al(torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("shape", [(1, 1, 5), (3, 4, 33), (5, 2, 1030)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_matches_float64(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    y = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    out = torch.full((shape[0], shape[2]), float("nan"), dtype=dtype, device=DEVICE)
    got = vm.moe_sum(y, out)
    assert got is out and not got.isnan().any()
    ref = y.double().sum(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="y"):
        vm.moe_sum(y[:, :, :1].expand(*shape))


def test_vllm_flags_are_vllms_choice_for_unquantized_weights():
    names = {"use_fp8_w8a8", "HAS_BIAS", "SWAP_AB", "USE_TD", "top_k"}
    flags, why = vm.vllm_flags(names, torch.bfloat16, (9, 0))
    assert flags == {"use_fp8_w8a8": False, "HAS_BIAS": False, "SWAP_AB": False, "USE_TD": False}
    assert "sm_90" in why and "SWAP_AB=0" in why and "USE_TD=0" in why
    assert vm.vllm_flags({"top_k"}, torch.float16, (8, 0))[0] == {}  # an older kernel without the flags
    with pytest.raises(TypeError, match="dtype"):
        vm.vllm_flags(names, torch.int8, (9, 0))


@pytest.mark.skipif(
    not os.environ.get("MOEGEMM_VLLM_SOURCE"), reason="needs MOEGEMM_VLLM_SOURCE (vLLM's source)"
)
@pytest.mark.parametrize("naive", [False, True])
def test_real_layer_matches_float64(cache, naive):
    """The whole expert FFN as vLLM's fused_experts runs it (align in the call, SiLU*up, the routing weights
    inside the down GEMM, moe_sum), fp32 under the interpreter, poisoned between calls."""
    vk = vm.load(os.environ["MOEGEMM_VLLM_SOURCE"])
    g = torch.Generator().manual_seed(5 + naive)
    e, k, t, h, i = (16, 2, 2, 24, 16) if naive else (4, 2, 5, 24, 16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    wts = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEVICE)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w_gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(DEVICE)
    w_dn = (torch.randn(e, h, i, generator=g) / i**0.5).to(DEVICE)
    assert vm.naive_assignment(t, k, e) == naive
    cfg = {
        "BLOCK_SIZE_M": 16,
        "BLOCK_SIZE_N": 32,
        "BLOCK_SIZE_K": 16,
        "GROUP_SIZE_M": 1,
        "num_warps": 4,
        "num_stages": 2,
    }
    call = vm.layer(vk, x, ids, wts, e, cfg)(w_gu, w_dn)
    call().fill_(float("nan"))
    got = call().double().cpu()
    ref = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            gu = w_gu[ex].double().cpu() @ x[tok].double().cpu()
            act = torch.nn.functional.silu(gu[:i]) * gu[i:]
            ref[tok] += float(wts[tok, j]) * (w_dn[ex].double().cpu() @ act)
    assert not got.isnan().any()
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
