"""Compare two eval pipeline runs question by question (evaluation/paired.py): same predictions, and per metric the
mean difference with its interval and the questions that went up or down.

    python scripts/compare_answers.py FIRST SECOND [--out FILE]

FIRST and SECOND are eval pipeline `out` folders; FILE (default SECOND/paired.json) is what the results page's
`answers_paired` table renders. Prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from overstory.evaluation.paired import compare_runs, paired_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path, help="the baseline run's out folder")
    parser.add_argument("second", type=Path, help="the run compared with it")
    parser.add_argument("--out", type=Path, help="the JSON report (default: SECOND/paired.json)")
    args = parser.parse_args()
    report = compare_runs(args.first, args.second)
    out = args.out or args.second / "paired.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(paired_table(report))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
