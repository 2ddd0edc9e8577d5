"""The capacity plan from the runs' metrics (bench/capacity.py; docs/capacity.md says what it computes).

    python scripts/capacity_plan.py --config configs/capacity.yaml --out runs/capacity

Writes capacity.json, capacity.md and capacity.png to the out folder and prints the table. Extra arguments are
config overrides (``fleet.gpus=16 targets.question=500000``).
"""

from __future__ import annotations

import argparse
import sys

from overstory.bench.capacity import CapacityConfig, markdown, run
from overstory.core.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    """Load the config (with overrides), compute and write the plan, print it; exit 2 on a bad config."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/capacity.yaml", help="the plan's YAML")
    parser.add_argument("--out", default="", help="the folder to write to (default: the config's out)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parser.parse_args(argv)
    overrides = args.overrides + ([f"out={args.out}"] if args.out else [])
    try:
        config = load_config(CapacityConfig, args.config, overrides)
        report = run(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"-> {config.out}/capacity.json, capacity.md, capacity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
