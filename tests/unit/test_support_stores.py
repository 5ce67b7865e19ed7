"""The shared analysis stores (``tests.support.stores``) hold what they claim."""

from __future__ import annotations

import numpy as np

from tests.support.stores import DIM, ZERO_ROW, synthetic_rows, synthetic_store


def test_synthetic_store_round_trips(tmp_path):
    store, true = synthetic_store(tmp_path / "s", num_classes=40)
    assert store.is_complete and true.shape == (40, DIM)
    assert np.array_equal(true, synthetic_rows(40, DIM))  # float32 stores are bit-exact
    assert not true[ZERO_ROW].any()
