"""docs/architecture.md's drawing holds the code's imports: every arrow between the house's rooms (the
library's packages, the harness, the experiments, the probes, the write-up, the workflow) is drawn, and
every drawn arrow exists; no arrow runs from the library outwards, and no two rooms import each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("src/moegemm", "experiments", "probes", "paper", "workflow")
LIBRARY_PACKAGES = ("grouped", "decompose_k", "inductor", "integrations", "tuned")


def room(module: str) -> str | None:
    """The room of a dotted module name (None: outside the house, e.g. torch)."""
    parts = module.split(".")
    head = parts[0]
    if head == "moegemm":
        if len(parts) > 1 and parts[1] in LIBRARY_PACKAGES:
            return "moegemm." + parts[1]  # (moegemm.grouped.fp8 is a room of moegemm.grouped)
        if len(parts) > 1 and parts[1] == "__main__":
            return "moegemm.__main__"
        return "moegemm"
    if head == "experiments":
        return "experiments.harness" if parts[1:2] == ["harness"] else "experiments"
    if head == "paper":
        return "paper." + parts[1] if parts[1:2] in (["numbers"], ["figures"]) else "paper"
    if head in ("probes", "workflow"):
        return head
    return None


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = parts[1:] if parts[0] == "src" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_arrows() -> set[tuple[str, str]]:
    arrows = set()
    for folder in FOLDERS:
        for f in (ROOT / folder).rglob("*.py"):
            mod = _module_of(f)
            pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
            src = room(mod)
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                        base = ".".join(up + ([node.module] if node.module else []))
                    targets = [base] + [f"{base}.{a.name}" for a in node.names]
                else:
                    continue
                for t in targets:
                    dst = room(t)
                    if dst and dst != src:
                        arrows.add((src, dst))
    return arrows


def drawn_arrows() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", text, flags=re.S).group(1)
    names = dict(re.findall(r'(\w+)\["([\w.]+)', block))
    return {(names[a], names[b]) for a, b in re.findall(r"^\s*(\w+)\s*-->\s*(\w+)\s*$", block, flags=re.M)}


def test_the_drawing_holds_every_import_arrow_and_no_other():
    code, drawn = import_arrows(), drawn_arrows()
    assert code - drawn == set(), f"imports not drawn: {sorted(code - drawn)}"
    assert drawn - code == set(), f"drawn arrows no import makes: {sorted(drawn - code)}"


def test_the_library_imports_nothing_outside_itself_and_no_two_rooms_import_each_other():
    arrows = import_arrows()
    assert not [(a, b) for a, b in arrows if a.startswith("moegemm") and not b.startswith("moegemm")]
    assert not [(a, b) for a, b in arrows if (b, a) in arrows]
