"""Shared test helpers: random operands in every layout, poisoned outputs, float64 comparisons, pairwise
covering arrays."""

from __future__ import annotations

import itertools

import pytest
import torch

from experiments.harness.correctness import TOL, atol_for  # noqa: F401 (TOL re-exported to tests)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("contiguous", "transposed", "sliced")


def cover(items: list, facets) -> list:
    """The items, in their order of choice, that together have every facet any of ``items`` has
    (``facets(item)``: a set of hashables): greedily, each next the item with the most facets not yet
    covered, ties to the earliest, so the same items give the same list on every run."""
    have = [facets(it) for it in items]
    todo = set().union(*have)
    chosen = []
    while todo:
        best = max(range(len(items)), key=lambda i: len(have[i] & todo))
        chosen.append(items[best])
        todo -= have[best]
    return chosen


def pairwise(**dims) -> list[dict]:
    """Combinations of the values of ``dims`` (name -> values), as dicts, in which every pair of values of
    two dims stands together at least once: a pairwise covering array, the full product's combinations
    chosen by ``cover`` with the dims in the order given and with the dims of most values first, whichever
    gives fewer (a greedy choice comes close to the fewest, not always as close in both orders). One dim
    alone: each of its values. A code path that parts at one value or where two values meet is exercised;
    one that needs three values together that no two of them select is not."""
    orders = (list(dims), sorted(dims, key=lambda n: -len(dims[n])))  # (a stable sort)
    return min((_pairwise(dims, names) for names in orders), key=len)


def _pairwise(dims: dict, names: list) -> list[dict]:
    values = [list(dims[n]) for n in names]
    # by index, so that values need not be hashable and equal values of one dim (0, False) stay apart
    product = list(itertools.product(*(range(len(v)) for v in values)))
    columns = list(itertools.combinations(range(len(names)), 2))
    chosen = cover(product, lambda c: {(a, c[a], b, c[b]) for a, b in columns}) if columns else product
    return [{n: values[names.index(n)][c[names.index(n)]] for n in dims} for c in chosen]


def cases(native: bool, **dims) -> list[dict]:
    """Combinations of the values of ``dims`` for a test: their full product where the kernels run natively
    (``native``: on a GPU, each case takes milliseconds), every pair of values (``pairwise``) under Triton's
    interpreter."""
    if not native:
        return pairwise(**dims)
    return [dict(zip(dims, combo)) for combo in itertools.product(*dims.values())]


def case_params(native: bool, **dims) -> list:
    """``cases(native, **dims)`` as pytest.param objects for ``parametrize`` with the dims' names in their
    order. A dim is a sequence of values or a dict of id -> value; the id of a case joins its values' ids
    with "-" in the dims' order, as pytest does for stacked parametrize decorators listed nearest the
    function first: a str, number, bool or None by its str, another value by its dim's name and index."""
    plain = (str, int, float, bool, type(None))
    named = {
        name: list(values.items())
        if isinstance(values, dict)
        else [(str(v) if isinstance(v, plain) else f"{name}{i}", v) for i, v in enumerate(values)]
        for name, values in dims.items()
    }
    return [
        pytest.param(*(v for _, v in c.values()), id="-".join(i for i, _ in c.values()))
        for c in cases(native, **named)
    ]


def make(
    shape: tuple[int, int], dtype: torch.dtype, layout: str, gen: torch.Generator, device
) -> torch.Tensor:
    """A fresh random [rows, cols] operand (never zeros) with the requested memory layout."""
    rows, cols = shape
    if layout == "contiguous":
        t = torch.randn(rows, cols, generator=gen)
    elif layout == "transposed":  # column-major: stride (1, rows)
        t = torch.randn(cols, rows, generator=gen).t()
    elif layout == "sliced":  # a view with padded leading stride and a non-zero offset
        t = torch.randn(rows + 3, cols + 5, generator=gen)[2 : rows + 2, 1 : cols + 1]
    else:
        raise AssertionError(layout)
    return t.to(dtype=dtype).to(device) if layout == "contiguous" else _keep_layout(t, dtype, device)


def _keep_layout(t: torch.Tensor, dtype, device) -> torch.Tensor:
    """Move/cast a view to (dtype, device) keeping its strides and storage offset."""
    base = t._base if t._base is not None else t
    base = base.to(dtype=dtype, device=device)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def poisoned(shape, dtype, device, layout: str = "contiguous") -> torch.Tensor:
    if layout == "transposed":
        return torch.full(tuple(reversed(shape)), float("nan"), dtype=dtype, device=device).t()
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close_to_ref(out: torch.Tensor, ref64: torch.Tensor, k: int, what: str = "") -> None:
    """Every element finite-or-equal-to-ref, within tolerance of the float64 reference."""
    rtol, atol = atol_for(out.dtype, k)
    got = out.detach().double()  # compared where the output lives: on a GPU, the real shapes are large
    ref64 = ref64.to(got.device)
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in output ({int(torch.isnan(got).sum())} elements)"
    torch.testing.assert_close(got, ref64, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    if ref64.numel():
        rel = ((got - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
        assert rel < 4 * rtol, f"{what}: relative error {rel:.2e} >= {4 * rtol:.1e}"


def assert_compiled_grads_match(step, tensors, rtol: float, atol: float) -> None:
    """``step(*tensors)`` (a scalar loss) eagerly and under torch.compile(fullgraph=True, aot_eager): the
    gradients of fresh leaf copies of ``tensors`` agree within rtol, atol."""
    eager = [t.detach().clone().requires_grad_() for t in tensors]
    step(*eager).backward()
    comp = [t.detach().clone().requires_grad_() for t in tensors]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*comp).backward()
    for e, c in zip(eager, comp):
        torch.testing.assert_close(c.grad, e.grad, rtol=rtol, atol=atol)
