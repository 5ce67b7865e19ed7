"""``check_png``: a plot the analysis commands wrote is a PNG of the expected pixel size that
decodes whole and is not blank (the plot tests of stores and of training logs)."""

from __future__ import annotations

import numpy as np
from PIL import Image


def check_png(path: str, size: tuple[int, int]) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == size
        image.verify()  # the whole file decodes (CRCs of every chunk)
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("L"))
    assert pixels.std() > 10  # something was drawn, not a blank canvas
