"""Re-render the README's generated tables from the metrics files of the runs in this checkout.

    python scripts/render_readme_tables.py            # rewrite README.md in place
    python scripts/render_readme_tables.py --check    # exit 1 when a table differs from its file

Tables whose file is missing here are kept as they are (see overstory/evaluation/report_tables.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overstory.evaluation.report_tables import render_readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    args = parser.parse_args()
    readme = Path(args.readme)
    text = readme.read_text()
    rendered, notes = render_readme(text, readme.parent)
    print("\n".join(notes) or "no generated tables in " + str(readme))
    if args.check:
        return int(rendered != text)
    readme.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
