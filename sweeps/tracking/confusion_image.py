"""The confusion matrix as a PNG beside ``eval/confusion_matrix.json``: the MLflow UI shows
images in a run's artifacts, not a JSON matrix. Rendered here (core/ writes only the JSON)."""
from __future__ import annotations

import json
from pathlib import Path

IMAGE_FILE = "confusion_matrix.png"


def render(matrix_json: Path, out: Path) -> Path:
    """Draw the matrix of ``matrix_json`` (core.finalize's file: ``{"matrix": [[...]], ...}`` or
    the bare matrix) into ``out``: counts per cell, rows = true class, columns = predicted."""
    # Figure + the Agg canvas, not pyplot: no global state, so trials in threads may draw at once.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = json.loads(matrix_json.read_text())
    matrix = data["matrix"] if isinstance(data, dict) else data
    n = len(matrix)
    size = min(12.0, 2.0 + 0.5 * n)
    fig = Figure(figsize=(size, size), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set(xlabel="predicted class", ylabel="true class", title="confusion matrix (validation)",
           xticks=range(n), yticks=range(n))
    if n <= 30:  # past that the numbers no longer fit in a cell
        top = max((max(row) for row in matrix), default=0)
        for i, row in enumerate(matrix):
            for j, count in enumerate(row):
                ax.text(j, i, str(count), ha="center", va="center", fontsize=8,
                        color="white" if top and count > top / 2 else "black")
    fig.tight_layout()
    fig.savefig(out)
    return out
