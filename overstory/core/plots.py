"""What every PNG report shares: matplotlib on the Agg backend (no display needed) and one way to save."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` as a PNG (creating the folder) and free it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
