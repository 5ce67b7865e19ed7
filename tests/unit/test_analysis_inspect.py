"""``classgrad inspect``: layout, completion and norm summaries equal numpy's on complete,
incomplete, low-precision and projected stores; the norms are computed in bands of columns
that cut through parameters, with the same result."""

from __future__ import annotations

import json

import numpy as np
import pytest

from classgrad.service.analysis.inspect import grad_norms, inspect_store
from classgrad.service.commands.cli import main as cli_main
from tests.support.stores import LAYOUT, ZERO_ROW, synthetic_store

U = 2.0**-24


def reference_param_sq(rows: np.ndarray) -> np.ndarray:
    x = rows.astype(np.float64) ** 2
    return np.stack([x[:, e.offset : e.offset + e.size].sum(axis=1) for e in LAYOUT], axis=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norms_match_numpy_with_bands_crossing_parameters(tmp_path, dtype):
    store, rows = synthetic_store(tmp_path / "s", num_classes=200, dtype=dtype, shards=[0, 2, 3])
    # 16 rows x 40 columns per read: bands [0, 40), [40, 80), [80, 96) cut layer.weight.
    norms = grad_norms(store, block_rows=16, block_mb=16 * 40 * 4 / 2**20)
    done = np.r_[0:64, 128:200]
    missing = np.r_[64:128]
    assert np.isnan(norms.row[missing]).all() and np.isnan(norms.param_sq[missing]).all()
    ref = np.linalg.norm(rows[done].astype(np.float64), axis=1)
    # Squares rounded to float32 (u relative each), summed in float64: ~u relative overall.
    assert norms.row[done] == pytest.approx(ref, rel=4 * U, abs=0)
    assert norms.param_sq[done] == pytest.approx(reference_param_sq(rows[done]), rel=4 * U, abs=0)
    assert norms.names == [e.name for e in LAYOUT]


def test_inspect_store_summary(tmp_path):
    store, rows = synthetic_store(
        tmp_path / "s", num_classes=200, shards=[0, 1, 3], class_names=tuple(f"class-{i}" for i in range(200))
    )
    info = inspect_store(store, top=3)
    assert info["shape"] == [200, 96] and info["dtype"] == "float32"
    assert [e["name"] for e in info["layout"]] == [e.name for e in LAYOUT]
    assert info["layout"][0] == {"name": "layer.weight", "shape": [8, 10], "size": 80, "offset": 0}
    assert info["completion"] == {
        "shards_done": 3,
        "shards_total": 4,
        "rows_done": 136,
        "complete": False,
        "missing_ranges": [[128, 192]],
    }
    done = np.r_[0:128, 192:200]
    ref = np.linalg.norm(rows[done].astype(np.float64), axis=1)
    n = info["class_norms"]
    assert n["n"] == 136 and n["zero_rows"] == 1  # ZERO_ROW is in shard 0
    # Norms are exact to a few float32 roundings (see the test above).
    assert n["max"] == pytest.approx(ref.max(), rel=4 * U)
    assert n["median"] == pytest.approx(np.median(ref), rel=4 * U)
    top = done[np.argsort(-ref)[:3]]
    assert [t["row"] for t in n["top"]] == top.tolist()
    assert n["top"][0]["name"] == f"class-{top[0]}"
    params = reference_param_sq(rows[done]).sum(axis=0)
    for p, ref_sq in zip(info["param_norms"], params):
        assert p["norm"] == pytest.approx(np.sqrt(ref_sq), rel=4 * U)
    assert sum(p["share"] for p in info["param_norms"]) == pytest.approx(1.0, rel=1e-12)
    assert info["similarity"] is None
    assert ZERO_ROW not in [t["row"] for t in n["top"]]


def test_projected_store_has_no_parameter_norms(tmp_path):
    store, rows = synthetic_store(tmp_path / "p", num_classes=64, projected=True, dim=24)
    info = inspect_store(store)
    assert info["layout"] == [] and info["param_norms"] == []
    assert info["projection"]["kind"] == "rademacher"
    assert info["class_norms"]["n"] == 64


def test_cli_text_and_json(tmp_path, capsys):
    synthetic_store(tmp_path / "s", num_classes=64)
    assert cli_main(["inspect", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    for expected in (
        "64 classes x 96 float32",
        "1/1 shards",
        "complete",
        "layer.weight",
        "(8, 10)",
        "class norms 64 rows",
        "param norms",
    ):
        assert expected in text, expected
    assert cli_main(["inspect", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["completion"]["complete"] and len(info["class_norms"]["top"]) == 5
    assert cli_main(["inspect", str(tmp_path / "absent")]) == 2
    assert "no classgrad store" in capsys.readouterr().err
