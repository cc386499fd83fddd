"""probes/probe_safety_cost.py on the CPU: the kernel it builds with the row bound left out is a second
kernel beside the library's, replays the library's recorded launch, and agrees with it on consistent
offsets; the library's kernels are left as they were."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.probe


def test_the_unbounded_kernel_replays_the_librarys_launch(device):
    from moegemm.grouped import grouped_mm, kernels
    from probes import probe_safety_cost as probe

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 32, generator=gen).to(device)
    w = torch.randn(3, 24, 32, generator=gen).to(device)
    off = torch.tensor([0, 4, 4, 11], device=device)
    launch = probe.recorded_launch(lambda: grouped_mm(x, w, off, validate=False))
    assert launch is not None and launch[0] in probe.FORWARD_KERNELS
    assert all("run" not in vars(getattr(kernels, n)) for n in probe.FORWARD_KERNELS)  # spies removed
    name, args, kw = launch
    alt = probe.unbounded_kernels()[name]
    assert alt is not getattr(kernels, name)
    expect = grouped_mm(x, w, off)
    y_out = [a for a in args if isinstance(a, torch.Tensor) and tuple(a.shape) == (11, 24)][0]
    y_out.fill_(float("nan"))
    alt.run(*args, **kw)
    torch.testing.assert_close(y_out, expect, rtol=0, atol=0)


def test_the_rebuilt_kernels_keep_their_constexpr_parameters():
    """Triton reads which parameters are compile-time constants from the annotations (the interpreter does
    not need them; a GPU compile does): each rebuilt function keeps its original's."""
    from moegemm.grouped import kernels, tiles
    from probes import probe_safety_cost as probe

    for name, alt in probe.unbounded_kernels().items():
        assert alt.fn.__annotations__ == getattr(kernels, name).fn.__annotations__, name
        plan = alt.fn.__globals__["_tile_plan"]
        assert plan is not tiles._tile_plan
        assert plan.fn.__annotations__ == tiles._tile_plan.fn.__annotations__
        assert any("constexpr" in str(a) for a in plan.fn.__annotations__.values())
