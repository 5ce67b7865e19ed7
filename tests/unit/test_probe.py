"""The probe set (``classgrad.workers.probe``): micro-batches in one order for every engine,
samples grouped by class, batches from tensors or datasets (channels-last on request), the
digest of the probe set as built, and the checks that name a bad probe set."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from classgrad.errors import InputError
from classgrad.workers import zoo
from classgrad.workers.probe import ProbeSet, tree_map_tensors
from tests.support.engine_cases import NUM_CLASSES
from tests.support.faulty import noisy_dataset


def test_micro_batches_cover_the_probe_set_in_order_with_a_short_last_one():
    probe = ProbeSet((torch.randn(11, 2), torch.zeros(11, dtype=torch.long)), batch_size=4)
    batches = list(probe.micro_batches())
    assert probe.num_micro_batches == 3 == len(batches)
    assert [b.index for b in batches] == [0, 1, 2]
    assert [b.indices.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


def test_a_dataset_and_a_tensor_pair_give_the_same_batches():
    x, y = zoo.synthetic_probe(NUM_CLASSES, 2, kind="vector", input_shape=(3,), seed=4)
    pair, dataset = ProbeSet((x, y)), ProbeSet(TensorDataset(x, y))
    assert torch.equal(dataset.targets, y) and len(dataset) == len(y)
    pick = torch.tensor([5, 0, 7])
    for probe in (pair, dataset):
        got_x, got_y = probe.batch(pick, torch.device("cpu"), torch.float64)
        assert got_x.dtype == torch.float64 and got_y.dtype == y.dtype  # only floating inputs are cast
        assert torch.equal(got_x, x[pick].double()) and torch.equal(got_y, y[pick])


def test_nested_inputs_are_indexed_and_mapped_leaf_by_leaf():
    x = {"a": torch.arange(8.0).view(4, 2), "b": (torch.arange(4), "tag")}
    doubled = tree_map_tensors(lambda t: t * 2, x)
    assert torch.equal(doubled["a"], x["a"] * 2) and torch.equal(doubled["b"][0], torch.arange(4) * 2)
    assert doubled["b"][1] == "tag"
    probe = ProbeSet(({"a": x["a"], "b": [x["b"][0]]}, torch.zeros(4, dtype=torch.long)))
    got = probe.inputs(torch.tensor([3, 1]))
    assert torch.equal(got["a"], x["a"][[3, 1]]) and torch.equal(got["b"][0], torch.tensor([3, 1]))


def test_check_finite_names_the_first_bad_sample_in_any_input():
    x = (torch.zeros(5, 2), {"m": torch.zeros(5, 3)})
    x[1]["m"][3, 2] = float("inf")
    x[0][4, 0] = float("nan")
    probe = ProbeSet((x, torch.zeros(5, dtype=torch.long)))
    with pytest.raises(InputError, match="NaN/Inf in the inputs of probe sample 3"):
        probe.check_finite()
    ProbeSet((torch.zeros(5, 2), torch.zeros(5))).check_finite()  # finite: no error


@pytest.mark.parametrize(
    "data,batch_size,message",
    [
        ((torch.zeros(3, 2), torch.zeros(3)), 0, "data.batch_size must be > 0, got 0"),
        ((torch.zeros(3, 2), torch.zeros(4)), 2, "data: 3 inputs but 4 targets"),
        ((torch.zeros(0, 2), torch.zeros(0)), 2, "the probe set is empty"),
        (TensorDataset(torch.zeros(0, 2), torch.zeros(0)), 2, "the probe set is empty"),
        (42, 2, "expected a Dataset of \\(input, target\\) or of dicts, a DataLoader, or a pair"),
    ],
)
def test_bad_probe_sets_are_refused_in_one_line(data, batch_size, message):
    with pytest.raises(InputError, match=message):
        ProbeSet(data, batch_size=batch_size)


@pytest.mark.parametrize("held", ["tensor", "tuple", "dataset"])
def test_probe_batches_gathered_channels_last_hold_the_same_values(held):
    from classgrad.workers.probe import ProbeSet

    x, y = zoo.synthetic_probe(NUM_CLASSES, 3, kind="image", input_shape=(3, 5, 7), seed=1)
    extra = torch.arange(len(y) * 2.0).view(len(y), 2)  # not an image: left as it is
    data = {"tensor": (x, y), "tuple": ((x, extra), y), "dataset": torch.utils.data.TensorDataset(x, y)}[held]
    probe = ProbeSet(data)
    pick = torch.tensor([7, 2, 11, 2, 0])
    got, labels = probe.batch(pick, torch.device("cpu"), torch.float32, memory_format=torch.channels_last)
    images = got[0] if held == "tuple" else got
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert torch.equal(images, x[pick]) and torch.equal(labels, y[pick])
    if held == "tuple":
        assert torch.equal(got[1], extra[pick]) and got[1].is_contiguous()
    plain, _ = probe.batch(pick, torch.device("cpu"), torch.float32)
    assert plain.is_contiguous() if held != "tuple" else plain[0].is_contiguous()


@pytest.mark.parametrize("as_dataset", [False, True], ids=["tensors", "dataset"])
def test_the_digest_covers_every_input_and_label(as_dataset):
    def probe_of(inputs: torch.Tensor, labels: torch.Tensor) -> ProbeSet:
        return ProbeSet(TensorDataset(inputs, labels) if as_dataset else (inputs, labels), batch_size=4)

    inputs, labels = zoo.synthetic_probe(NUM_CLASSES, samples_per_class=2, kind="vector", input_shape=[5], seed=1)
    digest = probe_of(inputs, labels).digest
    assert probe_of(inputs.clone(), labels.clone()).digest == digest  # the same data: the same digest
    other_input, other_label = inputs.clone(), labels.clone()
    other_input[-1, -1] += 1e-6  # one value of the last sample
    other_label[-1] = (other_label[-1] + 1) % NUM_CLASSES
    assert probe_of(other_input, labels).digest != digest
    assert probe_of(inputs, other_label).digest != digest


def test_a_dataset_hashed_later_has_the_digest_of_one_hashed_on_first_read():
    """``per_class_gradients`` does not hash a Dataset's inputs while reading its targets
    (``digest_now=False``); asked later, the digest is the same."""
    inputs, labels = zoo.synthetic_probe(NUM_CLASSES, samples_per_class=2, kind="vector", input_shape=[5], seed=1)
    data = TensorDataset(inputs, labels)
    later = ProbeSet(data, batch_size=4, digest_now=False)
    assert later._inputs_digest is None
    assert later.digest == ProbeSet(data, batch_size=4).digest


def test_a_dataset_whose_reads_differ_does_not_read_repeatably():
    kwargs = {"num_classes": NUM_CLASSES, "samples_per_class": 2, "kind": "vector", "input_shape": [5]}
    assert not ProbeSet(noisy_dataset(**kwargs)).reads_repeat()
    assert ProbeSet(TensorDataset(*zoo.synthetic_probe(**kwargs))).reads_repeat()
    assert ProbeSet(zoo.synthetic_probe(**kwargs)).reads_repeat()  # tensors: indexed, never re-read
