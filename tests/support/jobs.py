"""Small job configs for integration tests.

Holds ``small_job``: the dict of a fast job (48 classes, small CNN, 12 shards, 2 actors) whose
sections a test overrides one by one.
"""

from __future__ import annotations

from typing import Any


def small_job(store_url: str, **sections: Any) -> dict:
    """A job of 48 classes on a small CNN, 12 shards of 4 rows, 2 actors; override by section."""
    base: dict[str, Any] = {
        "model": {"factory": "classgrad.workers.zoo:small_cnn", "kwargs": {"num_classes": 48, "width": 4}},
        "data": {
            "factory": "classgrad.workers.zoo:synthetic_probe",
            "kwargs": {
                "num_classes": 48,
                "samples_per_class": 3,
                "imbalance": 1.0,
                "empty_classes": [5],
                "input_shape": [3, 8, 8],
                "seed": 2,
            },
            "batch_size": 16,
        },
        "loss": {"kind": "cross_entropy", "num_classes": 48},
        "sharding": {"shard_rows": 4},
        "store": {"url": store_url, "row_chunk": 2},
        "cluster": {"num_workers": 2, "num_cpus_per_worker": 1},
        "run": {"progress": "log", "log_every_s": 1.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base
