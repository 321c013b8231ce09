"""The confusion matrix as a PNG beside ``eval/confusion_matrix.json``: the MLflow UI shows
images in a run's artifacts, not a JSON matrix. Rendered here (core/ writes only the JSON).

Drawn with Pillow (installed with matplotlib, an MLflow dependency), not matplotlib: a
matplotlib figure with a number in every cell took seconds per trial on a busy core, Pillow
takes milliseconds, and it keeps no global state, so trials in threads may draw at once.
"""
from __future__ import annotations

import json
from pathlib import Path

IMAGE_FILE = "confusion_matrix.png"
_LOW, _HIGH = (247, 251, 255), (8, 48, 107)  # the ends of matplotlib's "Blues"


def _colour(fraction: float) -> tuple[int, int, int]:
    return tuple(round(lo + (hi - lo) * fraction) for lo, hi in zip(_LOW, _HIGH, strict=True))  # type: ignore[return-value]


def render(matrix_json: Path, out: Path) -> Path:
    """Draw the matrix of ``matrix_json`` (core.finalize's ``{"matrix": [[...]], ...}`` or the bare
    matrix) into ``out``: rows = true class, columns = predicted class, the count in each cell
    (up to 40 classes; past that the cells are too small for numbers, the colours remain)."""
    from PIL import Image, ImageDraw, ImageFont

    data = json.loads(matrix_json.read_text())
    matrix = data["matrix"] if isinstance(data, dict) else data
    n = len(matrix)
    cell = max(12, min(48, 960 // max(n, 1)))
    margin_left, margin_top = 70, 50
    size = (margin_left + n * cell + 10, margin_top + n * cell + 30)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    top = max((max(row) for row in matrix if row), default=0) or 1
    numbers = n <= 40
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            x, y = margin_left + j * cell, margin_top + i * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=_colour(count / top))
            if numbers:
                draw.text((x + cell / 2, y + cell / 2), str(count), anchor="mm", font=font,
                          fill="white" if count > top / 2 else "black")
        if numbers:  # class indices along both axes
            draw.text((margin_left - 6, margin_top + i * cell + cell / 2), str(i), anchor="rm", font=font, fill="black")
            draw.text((margin_left + i * cell + cell / 2, margin_top - 6), str(i), anchor="mb", font=font, fill="black")
    draw.text((margin_left, 8), "confusion matrix (validation): columns = predicted class", font=font, fill="black")
    draw.text((8, margin_top + n * cell + 8), "rows = true class", font=font, fill="black")
    image.save(out, format="PNG")
    return out
