"""Checks of format 3's xarray-facing metadata, shared by the unit and integration tests.

- ``open_zarr_strict``: ``xr.open_zarr(url)`` exactly as a user types it, any warning an error.
- ``assert_consolidated_fresh``: the group's consolidated metadata holds exactly the store's
  nodes, each as its own ``zarr.json`` says.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import xarray as xr


def open_zarr_strict(url) -> xr.Dataset:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return xr.open_zarr(str(url))


def assert_consolidated_fresh(url) -> None:
    root = json.loads((Path(url) / "zarr.json").read_text())
    held = root["consolidated_metadata"]["metadata"]
    on_disk = {p.parent.name: json.loads(p.read_text()) for p in Path(url).glob("*/zarr.json")}
    assert set(held) == set(on_disk)
    for name, node in on_disk.items():
        node.pop("consolidated_metadata", None)
        assert {k: v for k, v in held[name].items() if k != "consolidated_metadata"} == node, name
