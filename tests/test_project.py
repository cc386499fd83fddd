"""The project's promises about itself: README commands, CI script, pins, pipeline lint."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_gives_exactly_two_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert "snakemake --cores 1" in cmds[0] and "pip install" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = _readme_commands()[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1].strip() == test_cmd, "the last line of .ci/run must be the README's test command"
    install = _readme_commands()[0].split("&&")[1].strip()  # the pip install of command 1
    assert any(line.strip().endswith(install.split("pip ", 1)[1]) for line in ci), install


def test_pins_match_what_we_run():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for extra in meta["optional-dependencies"].values():
        for req in extra:
            name, _, ver = req.partition("==")
            assert ver, f"optional dependency {req!r} is not pinned"
            pins[name.lower()] = ver
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torch", "triton", "numpy", "pytest"):
        try:
            got = version(name)
        except PackageNotFoundError:  # pragma: no cover
            continue
        if name == "torch" and "+" not in got and not got.startswith(pins[name]):
            pytest.skip(f"torch {got} is not the CPU test build")  # e.g. the GPU image's torch 2.11
        if name in ("torch", "triton") and not got.startswith(pins[name]):
            pytest.skip(f"{name} {got}: not the pinned CPU environment")
        assert got.split("+")[0] == pins[name], f"{name}: installed {got}, pinned {pins[name]}"


@pytest.mark.pipeline
def test_snakemake_lint_is_clean():
    pytest.importorskip("snakemake")  # installed by the `pipeline` extra (CI has it; the bare GPU image not)
    res = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "MOEGEMM_FORCE_CPU": "1"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Lints for" not in out, out


def test_readme_is_short():
    """The README is the front page (at most 120 lines); the kernels' details live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, len(lines)
    for link in re.findall(r"\]\(((?:docs|figures|results)/[^)#]+)\)", "\n".join(lines)):
        assert (ROOT / link).exists(), link
