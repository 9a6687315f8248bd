"""matplotlib without a display: one figure of side-by-side panels per scenario."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any


def panels(count: int, width: float = 5.0, height: float = 3.8, rows: int = 1) -> tuple[Any, list[Any]]:
    """`count` panels of `width` x `height` inches, filled row by row over `rows` rows."""
    import matplotlib

    matplotlib.use("Agg")  # headless; chosen here, not at import, so importing bench stays cheap
    import matplotlib.pyplot as plt

    columns = -(-count // rows)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    cells = list(axes.flat)
    for spare in cells[count:]:
        spare.axis("off")
    return fig, cells[:count]


def label(axes: Sequence[tuple[Any, str, str]], *, prefix: str, xlabel: str, log2_x: bool = False) -> None:
    """Title `prefix: title`, axis labels and legend for each (axis, title, y unit)."""
    for ax, title, unit in axes:
        if log2_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.set_title(f"{prefix}: {title}")
        ax.legend(fontsize=7)


def save(fig: Any, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# One colour per target in every plot, so panels read together.
COLORS = {"direct": "tab:blue", "nginx": "tab:orange", "relay alone": "tab:gray", "qosgate": "tab:green",
          "qosgate v1": "tab:olive", "qosgate HTTP": "tab:purple", "qosgate redis": "tab:red"}
