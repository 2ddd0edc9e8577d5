"""docs/api.md's examples run: every ``python`` block of the page, in order, in one namespace (as a reader pastes
them into one session), on the built-in models; a ``python no-run`` block (it needs a running server) is compiled."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BLOCK = re.compile(r"^```(python[^\n]*)\n(.*?)^```$", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    """(info string, code) of every python block of the page."""
    return [(info.strip(), code) for info, code in BLOCK.findall(PAGE.read_text())]


def test_the_api_page_runs(capsys) -> None:
    found = blocks()
    runnable = [code for info, code in found if info == "python"]
    assert len(runnable) >= 6, f"docs/api.md lost its examples: {[info for info, _ in found]}"
    namespace: dict = {"__name__": "docs_api"}
    for i, code in enumerate(runnable):
        exec(compile(code, f"docs/api.md block {i + 1}", "exec"), namespace)
    for info, code in found:
        if info != "python":
            assert info == "python no-run", f"unknown block kind {info!r}"
            compile(code, "docs/api.md no-run block", "exec")
    printed = capsys.readouterr().out
    # the first example's evidence is printed: ids of the page's own documents, with their levels
    assert re.search(r"\d\.\d{3}  (tea|coffee)#p\d  \[paragraph\]", printed), printed
    assert "unknown config key 'naive.kk'; did you mean 'naive.k'?" in printed
    assert namespace["found"].evidence, "the last retrieve found nothing"
    assert namespace["answered"].cost.roles["generator"]["calls"] == 1
