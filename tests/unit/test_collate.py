"""Dict samples and how they become batches (``classgrad.workers.collate`` and the probe set on top
of it): the label key, padding per batch, a DataLoader's dataset and collate_fn, a Hugging Face
style dataset, the probe digest over dict samples, and the one-line errors of bad dict data."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from classgrad.errors import InputError
from classgrad.workers.collate import pad_stack, stack
from classgrad.workers.probe import ProbeSet
from tests.support import hf_jobs

CPU = torch.device("cpu")


def test_pad_stack_pads_each_key_at_the_end_with_its_value_and_keeps_text():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "mask": torch.tensor([1, 1, 1]), "text": "a b c", "y": 1},
        {"input_ids": torch.tensor([8]), "mask": torch.tensor([1]), "text": "d", "y": 0},
    ]
    batch = pad_stack(items, {"input_ids": 9})
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert batch["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]  # default pad 0: hidden
    assert batch["text"] == ["a b c", "d"] and batch["y"].tolist() == [1, 0]
    with pytest.raises(InputError, match="different shapes .* set data.collate=pad"):
        stack(items)


def test_dict_samples_take_the_label_field_out_of_the_inputs():
    probe = ProbeSet(hf_jobs.job_text_rows(3, per_class=2, seed=0), batch_size=4, collate="pad")
    assert probe.targets.tolist() == [0, 0, 1, 1, 2, 2]
    x, y = probe.batch(torch.tensor([4, 0]), CPU)
    assert sorted(x) == ["attention_mask", "input_ids", "text"] and y.tolist() == [2, 0]
    lengths = x["attention_mask"].sum(dim=1).tolist()
    assert x["input_ids"].shape[1] == max(lengths)  # padded to the longest of this batch only
    # "label" when there is no "labels"; data.label_field names any other key.
    assert ProbeSet(hf_jobs.job_hf_rows(3, 1, seed=0), collate="pad").targets.tolist() == [0, 1, 2]
    named = ProbeSet(hf_jobs.job_text_rows(3, 1, seed=0, label_field="topic"), collate="pad", label_field="topic")
    assert named.targets.tolist() == [0, 1, 2]


def test_a_dict_of_columns_is_split_into_inputs_and_labels():
    cols = {"features": torch.randn(4, 2), "labels": torch.tensor([1, 0, 1, 0])}
    probe = ProbeSet(cols)
    x, y = probe.batch(torch.tensor([2, 1]), CPU)
    assert list(x) == ["features"] and torch.equal(x["features"], cols["features"][[2, 1]])
    assert y.tolist() == [1, 0]


def test_a_dataloader_gives_its_dataset_and_collate_fn_not_its_order():
    loader = hf_jobs.job_text_loader(3, per_class=2, seed=0)
    probe = ProbeSet(loader, batch_size=4)
    assert probe.targets.tolist() == [0, 0, 1, 1, 2, 2]  # dataset order, not the shuffled one
    x, _ = probe.batch(torch.tensor([0, 1]), CPU)
    assert sorted(x) == ["attention_mask", "input_ids"]  # what pad_collate returns, labels taken out
    plain = ProbeSet(DataLoader(hf_jobs.job_vector_rows(2, 2), batch_size=3, shuffle=True))
    assert plain.targets.tolist() == [0, 0, 1, 1]  # torch's default collate: the configured one is used
    with pytest.raises(InputError, match="the DataLoader has its own collate_fn"):
        ProbeSet(loader, collate="pad")


def test_the_digest_covers_dict_inputs():
    a = ProbeSet(hf_jobs.job_text_rows(3, 2, seed=0), collate="pad")
    data = hf_jobs.job_text_rows(3, 2, seed=0)
    data.rows[3]["input_ids"] = data.rows[3]["input_ids"].flip(0)  # one sample's tokens reordered
    assert ProbeSet(data, collate="pad").digest != a.digest
    assert ProbeSet(hf_jobs.job_text_rows(3, 2, seed=0), collate="pad").digest == a.digest
    assert a.reads_repeat()


class Rows:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.parametrize(
    "rows,options,message",
    [
        (
            [{"x": torch.zeros(2), "labels": 0}, {"x": torch.zeros(2)}],
            {},
            r"data: item 1 has no label key 'labels' \(it has: x\)",
        ),
        ([{"x": torch.zeros(2), "y": 0}], {}, r"dict samples without a label key \(labels or label; keys: x, y\)"),
        ([{"x": torch.zeros(2), "y": 0}], {"label_field": "target"}, "item 0 has no label key 'target'"),
        ([(torch.zeros(2), 0)], {"label_field": "y"}, "data.label_field 'y': the samples are .input, target. pairs"),
        ([torch.zeros(2)], {}, "a sample is a Tensor; expected .input, target. or a dict"),
    ],
)
def test_bad_dict_data_is_refused_in_one_line(rows, options, message):
    with pytest.raises(InputError, match=message):
        ProbeSet(Rows(rows), **options)


def test_a_collate_function_that_fails_is_one_line():
    def broken(items):
        raise KeyError("input_ids")

    probe = ProbeSet(hf_jobs.job_text_rows(2, 1, seed=0), collate=broken)
    with pytest.raises(InputError, match="data: collating a batch raised KeyError: 'input_ids'"):
        probe.batch(torch.tensor([0, 1]), CPU)


def test_a_dataloader_over_an_iterable_dataset_is_one_line():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield {"x": torch.zeros(2), "labels": 0}

    with pytest.raises(InputError, match="a DataLoader over an IterableDataset: the probe set needs a map-style"):
        ProbeSet(DataLoader(Stream()))
