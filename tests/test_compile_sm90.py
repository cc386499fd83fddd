"""Every kernel variant compiles for sm_90 (Hopper) with the installed Triton, checked without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SHARDS = 6  # compiled in parallel processes where pytest-xdist spreads the tests


@pytest.mark.long
@pytest.mark.compile_only
@pytest.mark.parametrize("shard", range(SHARDS))
def test_all_kernels_compile_for_sm90(shard):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_check.py")
    # the script imports the experiments' stream kernels too: the checkout's root on its path, as pytest's own
    root = str(script.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run(
        [sys.executable, str(script), "--shard", f"{shard}/{SHARDS}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    last = res.stdout.strip().splitlines()[-1]
    m = re.match(r"0 failed of (\d+) \(shard \d+/\d+ of (\d+) variants\)", last)
    assert m, out[-2000:]
    assert res.stdout.count("ok  ") == int(m.group(1)) > 0, out[-2000:]
    assert int(m.group(2)) >= 132, out[-2000:]  # every variant, all shards together
