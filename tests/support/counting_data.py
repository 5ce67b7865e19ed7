"""A probe set that records which samples are read, for tests of who reads what (an actor should
read only the samples its shards need).

Holds ``READS`` (the indices read so far in this process, in order) and ``counting_probe`` (a
data factory: ``synthetic_probe``'s vectors as a map-style Dataset whose ``__getitem__`` records
each read). With the environment variable ``COUNTING_PROBE_RELABEL`` set to an index, that
sample's label is shifted by one: a node whose data differs from the driver's.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from classgrad.workers.zoo import synthetic_probe

READS: list[int] = []
RELABEL = "COUNTING_PROBE_RELABEL"


class CountingDataset(Dataset):
    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int):
        self.inputs, self.labels = inputs, labels.clone()
        if os.environ.get(RELABEL):
            i = int(os.environ[RELABEL])
            self.labels[i] = (self.labels[i] + 1) % num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        READS.append(int(index))
        return self.inputs[index], self.labels[index]


def counting_probe(num_classes: int = 12, samples_per_class: int = 2, features: int = 6) -> CountingDataset:
    inputs, labels = synthetic_probe(num_classes, samples_per_class, kind="vector", input_shape=[features])
    return CountingDataset(inputs, labels, num_classes)
