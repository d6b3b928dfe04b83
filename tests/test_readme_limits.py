"""README's "Limits" figures are docs/benchmarks.md's current ones: every measured figure there
(a number or range in ms, s, x or %) appears, as written, on the benchmarks page, so a figure
re-measured there cannot leave a stale copy in the README."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUM = r"\d+(?:\.\d+)?"
FIGURE = re.compile(rf"\+?{NUM}(?:-{NUM})? ?(?:ms|s|x|%)(?!\w)")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_readme_limits_figures_are_the_benchmarks_pages() -> None:
    readme = (ROOT / "README.md").read_text()
    limits = _flat(readme[readme.index("## Limits (today)") : readme.index("## Layout")])
    bench = _flat((ROOT / "docs" / "benchmarks.md").read_text())
    figures = FIGURE.findall(limits)
    assert len(figures) > 10, figures  # the section still quotes measurements
    stale = [f for f in figures if f not in bench]
    assert not stale, f"README Limits figures not on docs/benchmarks.md: {stale}"
