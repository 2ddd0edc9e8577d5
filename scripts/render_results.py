"""Re-render the generated tables of docs/results.md from the metrics files of the runs in this checkout.

    python scripts/render_results.py            # rewrite docs/results.md in place
    python scripts/render_results.py --check    # exit 1 when a table differs from its file

Each table sits between ``<!-- table: KIND FILE -->`` and ``<!-- /table -->``; FILE is relative to the repository
root (``runs/...``). A table whose file is missing here is kept as it is (see overstory/evaluation/report_tables.py),
so figures measured on another machine stay until their run is repeated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overstory.evaluation.report_tables import render_results_page

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    """Render the page (or only compare it, with ``--check``); print one line per table saying what happened."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "results.md", help="the page to render")
    parser.add_argument("--root", type=Path, default=ROOT, help="the folder the tables' file paths start from")
    parser.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    args = parser.parse_args()
    text = args.page.read_text()
    rendered, notes = render_results_page(text, args.root)
    print("\n".join(notes) or f"no generated tables in {args.page}")
    if args.check:
        return int(rendered != text)
    args.page.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
