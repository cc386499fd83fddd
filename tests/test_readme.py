"""What the README (and the write-up's READMEs and docs) promise, checked as behaviour rather than wording:
the commands it gives exist as written (the test command is the one CI runs, the extras it installs are
pyproject's, every Snakemake rule, config key, resource and profile it names is the pipeline's, every module
it runs with `python -m` is there), every path it names and every link it makes resolves to a file of the
checkout. Its first code block runs (tests/test_quickstart.py), its library excerpt is what the quick start
runs (tests/test_project.py) and its generated blocks are what the generator makes of the committed results
(tests/test_pipeline.py)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GPU = yaml.safe_load((ROOT / "experiments" / "config.yaml").read_text())["committed_results"]
# Markdown the project writes for readers: the README, the write-up's and the figures' index, the docs
MARKDOWN = [
    README,
    ROOT / "paper" / "README.md",
    ROOT / "figures" / "README.md",
    ROOT / "results" / "README.md",
]
MARKDOWN += sorted((ROOT / "docs").glob("*.md"))
# Top-level folders of the checkout a path named in the README starts with
TOPS = (
    "src",
    "experiments",
    "probes",
    "paper",
    "figures",
    "results",
    "docs",
    "tests",
    "examples",
    "workflow",
)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)\n```", text, flags=re.S)


def _code(text: str) -> list[str]:
    """Every command line of a Markdown text: the lines of its fenced blocks (comments cut) and its inline
    code spans."""
    lines = [ln for b in re.findall(r"```\w*\n(.*?)\n```", text, flags=re.S) for ln in b.splitlines()]
    lines = [ln.split("  #", 1)[0].strip() for ln in lines]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [ln for ln in lines if ln] + re.findall(r"`([^`\n]+)`", prose)


def _rules() -> set[str]:
    """The pipeline's rules, as its Snakefile and workflow/rules/ define them."""
    files = [ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]
    return {m for f in files for m in re.findall(r"^\s*rule (\w+):", f.read_text(), flags=re.M)}


def _snakemake_calls(text: str) -> list[list[str]]:
    """The arguments of every `snakemake ...` command in ``text``'s code (one per command of a `&&` chain)."""
    calls = []
    for line in _code(text):
        for part in line.split("&&"):
            if "snakemake" not in part:
                continue
            words = shlex.split(part)
            for i, w in enumerate(words):
                if w == "snakemake" or w.endswith("/snakemake"):
                    calls.append(words[i + 1 :])
                    break
    return calls


def _options(args: list[str]) -> dict[str, list[str]]:
    """{option: the words after it up to the next option} of a command line (positional words under "")."""
    out: dict[str, list[str]] = {"": []}
    key = ""
    for a in args:
        if a.startswith("-"):
            key = a
            out.setdefault(key, [])
        else:
            out[key].append(a)
    return out


def test_the_test_command_is_the_one_ci_runs():
    """The README's one pytest command is the last line of .ci/run, which installs the extras the README's
    install command installs and lints with the ruff the `test` extra pins."""
    cmds = [b.strip() for b in _blocks(README.read_text(), "bash") if "pytest" in b]
    assert len(cmds) == 1, cmds
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci[-1] == cmds[0], "the last line of .ci/run must be the README's test command"
    install = [c for c in _code(README.read_text()) if "pip install" in c]
    assert install, "the README gives no install command"
    pip = re.search(r"pip install (.*?)(?:&&|$)", install[0]).group(1).strip()
    assert any(line.endswith(pip) for line in ci), pip
    assert ".venv/bin/ruff check ." in ci


def test_the_extras_it_installs_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set()
    for md in MARKDOWN:
        for m in re.finditer(r"pip install [^`\n]*?'?\.\[([\w,]+)\]", md.read_text()):
            named |= set(m.group(1).split(","))
    assert named and named <= set(extras), named - set(extras)


def test_the_snakemake_commands_it_gives_are_the_pipelines():
    """Every `snakemake` command of the README and the docs: the rules it forces or allows are rules of the
    pipeline, its --config keys are in the config's schema, its --resources are those the rules declare, its
    profile is a folder of the checkout; and the README gives the one-command run."""
    rules = _rules()
    schema = yaml.safe_load((ROOT / "experiments" / "config.schema.yaml").read_text())["properties"]
    smk = "\n".join(p.read_text() for p in (ROOT / "workflow" / "rules").glob("*.smk"))
    declared = {
        r
        for block in re.findall(r"resources:\n((?:\s+\w+=.*\n)+)", smk)
        for r in re.findall(r"(\w+)=", block)
    }
    calls = [(md, c) for md in MARKDOWN for c in _snakemake_calls(md.read_text())]
    assert ["--cores", "1"] in [c for md, c in calls if md == README]
    for md, args in calls:
        name, opts = md.relative_to(ROOT), _options(args)
        for opt in ("--forcerun", "-R", "--allowed-rules", "--until", "--omit-from"):
            unknown = set(opts.get(opt, [])) - rules
            assert not unknown, f"{name}: {opt} names no rule: {sorted(unknown)}"
        for kv in opts.get("--config", []):
            assert kv.split("=", 1)[0] in schema, f"{name}: --config {kv}: not in the schema"
        for kv in opts.get("--resources", []):
            assert kv.split("=", 1)[0] in declared, f"{name}: --resources {kv}: no rule declares it"
        for prof in opts.get("--profile", []):
            assert (ROOT / prof).is_dir(), f"{name}: --profile {prof}"
        for target in opts[""]:  # a file the pipeline makes: a figure, the paper
            if "/" in target:
                path = target.replace("<gpu>", GPU)
                assert "<" in path or (ROOT / path).exists(), f"{name}: target {target}"


def test_the_modules_it_runs_exist():
    """Every `python -m <module>` of the README and the docs is a module of the checkout (or an installed
    one: pytest, venv)."""
    import sys

    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    try:
        for md in MARKDOWN:
            for line in _code(md.read_text()):
                for mod in re.findall(r"python3? -m ([\w.]+)", line):
                    mod = mod.rstrip(".")
                    assert importlib.util.find_spec(mod) is not None, (
                        f"{md.relative_to(ROOT)}: python -m {mod}"
                    )
    finally:
        del sys.path[:2]


def _named_paths(text: str) -> list[str]:
    """The checkout's paths a Markdown text names in its code: words that start with a top-level folder (or
    .ci/, or name a top-level file). A path of some GPU's results (results/<gpu>/...) is read as the committed
    GPU's folder: what a run writes there need not be committed, the folder must."""
    out = []
    for span in _code(text):
        for word in span.split():
            word = word.strip("`'\"(),;:")
            if "<gpu>" in word or "<gpu-slug>" in word:
                word = re.split(r"<gpu(?:-slug)?>", word)[0] + GPU + "/"
            top = word.split("/", 1)[0]
            if "<" in word or "*" in word or "{" in word or "$" in word:
                continue
            if (top in TOPS or top == ".ci") and "/" in word or word in ("Snakefile", "CITATION.cff"):
                out.append(word)
    return out


def test_the_paths_it_names_exist():
    paths = _named_paths(README.read_text())
    assert "examples/quickstart.py" in paths and ".ci/record-cpu-times" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the README names paths the checkout lacks: {missing}"


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_its_links_resolve(md):
    """Every relative link of the README, the write-up's READMEs and the docs is a file or folder of the
    checkout (as GitHub resolves it: from the Markdown file's own folder)."""
    links = [
        link.split("#", 1)[0]
        for link in re.findall(r"\]\(([^)\s]+)\)", md.read_text())
        if not re.match(r"[a-z]+:", link) and not link.startswith("#")
    ]
    missing = [link for link in links if not (md.parent / link).exists()]
    assert not missing, f"{md.relative_to(ROOT)} links to what is not there: {missing}"
