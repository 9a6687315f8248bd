"""matplotlib without a display: one figure of side-by-side panels per scenario."""

from __future__ import annotations

import pathlib
from typing import Any


def panels(count: int, width: float = 5.0, height: float = 3.8) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")  # headless; chosen here, not at import, so importing bench stays cheap
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return fig, list(axes[0])


def save(fig: Any, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# One colour per target in every plot, so panels read together.
COLORS = {"direct": "tab:blue", "nginx": "tab:orange", "qosgate": "tab:green"}
