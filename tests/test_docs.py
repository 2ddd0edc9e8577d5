"""The user docs: a short README that says where the code is, links that resolve, one results page.

The README is the first page a user reads (what it is, the two set-up commands, the recipe table, where to read
more); the rest lives in docs/, and every measured figure on docs/results.md, whose generated tables
scripts/render_results.py re-renders from the runs' metrics files.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from overstory.evaluation.report_tables import MARKER, RENDERERS
from overstory.jobs import JOBS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(path: Path) -> str:
    """The page without its fenced code blocks (a `#` line in a block is no heading, a `[x](y)` no link)."""
    return FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(path), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_to_a_file_and_anchor(page: Path) -> None:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_is_short_and_shows_the_two_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    assert "make quickstart" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_first_screen_maps_each_top_level_folder_to_its_package() -> None:
    """A newcomer who looks for overstory/training/ learns on the first screen that it is training/."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    parts = {name: folder for name, folder in mapping.items() if name != "overstory"}
    assert len(parts) >= 6
    for name, folder in parts.items():
        assert f"| `{folder}/` | `{name}` |" in first_screen, f"{folder}/ -> {name} missing from the README's top"
    package_doc = (ROOT / "overstory" / "__init__.py").read_text()
    for name, folder in parts.items():
        assert re.search(rf"{re.escape(name)}\s+{re.escape(folder)}/", package_doc), name


def test_recipe_table_names_every_job_with_an_existing_config() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `overstory ")]
    commands = {re.match(r"\| `(overstory [^`]*)`", row)[1].removesuffix(" --engine vllm") for row in rows}
    jobs = {" ".join(["overstory", group, name]).strip() for group, name in JOBS}
    assert jobs <= commands, f"jobs missing from the README's recipe table: {sorted(jobs - commands)}"
    configs = {c for row in rows for c in re.findall(r"`(configs/[^`]+\.yaml)`", row)}
    assert configs and all((ROOT / c).exists() for c in configs), sorted(c for c in configs if not (ROOT / c).exists())


def test_results_page_tables_name_known_renderers_and_every_figure_has_its_machine_and_date() -> None:
    results = (ROOT / "docs" / "results.md").read_text()
    kinds = [match["kind"] for match in MARKER.finditer(results)]
    assert kinds and set(kinds) <= set(RENDERERS)
    rendered = results.split("## Recorded figures", 1)[0].split("## Rendered tables", 1)[1]
    for block in rendered.split("\n### ")[1:]:
        assert "**Machine**" in block and re.search(r"\*\*Date\*\*: \d{4}-\d\d-\d\d", block), block[:60]
        assert "<!-- table:" in block and "**File**" in block, block[:60]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_carry_no_session_history(page: Path) -> None:
    assert not re.search(r"\bsessions? \d+|\bthis session\b", page.read_text(), re.I)
