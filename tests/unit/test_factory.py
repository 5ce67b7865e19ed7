"""Building a job from its config (``classgrad.workers.runtime.factory``): checkpoints."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from classgrad.service.errors import InputError
from tests.support.engine_cases import NUM_CLASSES
from classgrad.workers import zoo
from classgrad.workers.runtime.factory import build_model, load_checkpoint

# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoints_load_from_torch_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    source = zoo.mlp(NUM_CLASSES, seed=7)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "w.pt")
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    for name in ("w.pt", "w.safetensors"):
        model = build_model("classgrad.workers.zoo:mlp", {"num_classes": NUM_CLASSES}, str(tmp_path / name), "eval")
        assert not model.training
        for a, b in zip(model.state_dict().values(), source.state_dict().values()):
            assert torch.equal(a, b)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('CLASSGRAD_PWNED', '/nonexistent/pwned')}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_checkpoint_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("CLASSGRAD_PWNED", str(marker))
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"state_dict": _Payload()}))
    with pytest.raises(InputError, match="refused, not a plain weights file"):
        load_checkpoint(zoo.mlp(NUM_CLASSES), str(path))
    assert not marker.exists()


def test_checkpoint_that_does_not_fit_is_refused(tmp_path):
    torch.save(zoo.mlp(NUM_CLASSES, hidden=8).state_dict(), tmp_path / "w.pt")
    with pytest.raises(InputError, match="does not fit the model"):
        load_checkpoint(zoo.small_cnn(NUM_CLASSES), str(tmp_path / "w.pt"))
