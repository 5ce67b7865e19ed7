"""Per-class rows through recurrent modules in eval mode (``engines.base.rnns_ready_for_backward``).

On a GPU, cuDNN's RNN kernels keep what their backward needs only in train mode: a backward
through an eval-mode ``nn.LSTM`` raises ("cudnn RNN backward can only be called in training
mode"). The engines' forwards therefore run an eval-mode RNN whose dropout does nothing in train
mode (the same values), and one whose dropout eval mode turns off with cuDNN off. Checked here:
what each module sees in the forward, that the model is as it was afterwards, and the rows
against the float64 reference, on the CPU and (``cuda``) on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from classgrad.workers.engines.base import rnns_ready_for_backward
from classgrad.workers.gradients import per_class_gradients
from tests.support.devices import DEVICES
from tests.support.engine_cases import max_relative_error

C = 5


class Recurrent(nn.Module):
    """A one-layer LSTM (dropout does nothing) and a two-layer GRU with dropout 0.5 (eval mode
    turns it off), then a Linear on the last step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.gru = nn.GRU(8, 6, num_layers=2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(6, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.lstm(x)[0])[0][:, -1])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3 * C, 7, 4, generator=g), torch.arange(C).repeat(3)


def test_in_the_forward_each_rnn_runs_as_its_dropout_allows_and_is_put_back() -> None:
    model = Recurrent().eval()
    seen = {}
    for name in ("lstm", "gru"):
        module = getattr(model, name)
        module.register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, (m.training, torch.backends.cudnn.enabled))
        )
    cudnn = torch.backends.cudnn.enabled
    with rnns_ready_for_backward(model):
        model(_data()[0])
    assert seen == {"lstm": (True, False), "gru": (False, False)}  # cuDNN off: the GRU's dropout is off
    assert not model.lstm.training and not model.gru.training and torch.backends.cudnn.enabled == cudnn
    only_lstm = nn.Sequential(nn.LSTM(4, 3)).eval()
    with rnns_ready_for_backward(only_lstm):
        assert only_lstm[0].training and torch.backends.cudnn.enabled == cudnn  # cuDNN stays on


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["partitioned", "dense"])
def test_rows_of_an_eval_mode_rnn_model_equal_the_reference(engine: str, device: str) -> None:
    model = Recurrent().eval()
    x, y = _data()
    want = per_class_gradients(copy.deepcopy(model).double(), (x.double(), y), num_classes=C, engine="reference")
    got = per_class_gradients(model, (x, y), num_classes=C, engine=engine, device=device).cpu()
    # fp32 against float64 through 7 recurrent steps of two layers: the engine tests' 1e-5.
    assert max_relative_error(got, want) <= 1e-5
    assert not model.lstm.training and not model.gru.training
