"""The models and probe sets the reads from the device are counted on (``tests/unit/test_host_reads.py``,
``benchmarks/host_reads.py``, ``benchmarks/gpu_proof.py``'s ``syncs``): no pytest needed.

Holds ``MODELS`` (name -> builder of ``num_classes``: the zoo's MLP and small CNN, the tiny
Hugging Face configs, the LSTM), ``probe`` (classes of 1 to 4 samples, shuffled) and
``counted`` (the reads and ops of a warm ``per_class_gradients`` call, and its runs).
"""

from __future__ import annotations

import contextlib

import torch

from classgrad import PerClassGradScaler
from classgrad.workers import zoo
from classgrad.workers.engines import host_device
from classgrad.workers.engines.layer_rules.rule_io import routes_as
from classgrad.workers.engines.partitioned.hook_path import HookPath
from classgrad.workers.gradients import per_class_gradients
from classgrad.workers.probe import ProbeSet
from tests.support.hf_models import hf_probe, lstm_classifier, tiny_bert, tiny_gpt2, tiny_resnet, tiny_vit
from tests.support.host_reads import HostReads

MODELS = {
    "mlp": lambda c: zoo.mlp(c, in_features=10),
    "cnn": lambda c: zoo.small_cnn(c, width=4),
    "bert": tiny_bert,
    "gpt2": tiny_gpt2,
    "vit": tiny_vit,
    "resnet": tiny_resnet,
    "lstm": lstm_classifier,
}
# The probe's inputs for each model (hf_probe's kinds: vectors of 10 features, 3x8x8 images, tokens).
INPUTS = {"mlp": "ln_mlp", "cnn": "vit", **{name: name for name in ("bert", "gpt2", "vit", "resnet", "lstm")}}


def probe(name: str, num_classes: int, seed: int = 0):
    """Classes of 1 to 4 samples (class c has 1 + c % 4), shuffled."""
    sizes = 1 + torch.arange(num_classes) % 4
    labels = torch.arange(num_classes).repeat_interleave(sizes)
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]
    inputs, _ = hf_probe(INPUTS[name], 1, per_class=len(labels), seed=seed)
    return inputs, labels


def counted(
    model, data, num_classes: int, projection: dict | None, routes: str | None, batch_size: int = 256
) -> tuple[HostReads, int]:
    """The reads and ops of a warm ``per_class_gradients`` call (the loaded batch and the engine's
    ``to_device`` copies are device data, ``read_back`` and ``to_host`` one read each, the model's
    own forward counted apart, the ops inside a run in ``ops_in_scope``), and its runs (the hook
    path's plans); ``routes``: ``"cuda"`` for a GPU's routes, None for this CPU's."""
    kwargs = dict(num_classes=num_classes, batch_size=batch_size, progress=False, projection=projection)
    with routes_as(routes) if routes else contextlib.nullcontext():
        per_class_gradients(model, data, **kwargs)  # the once-per-process spot check and choices
        reads = HostReads(model)
        reads.on_device(ProbeSet, "batch").on_device(host_device, "to_device")
        reads.read_point(host_device, "read_back").read_point(host_device, "to_host").within(model, "forward")
        reads.calls_of(HookPath, "_plan").scope(HookPath, "_rows")
        with reads:
            per_class_gradients(model, data, **kwargs)
    return reads, reads.calls


def step_counted(name: str, num_classes: int, routes: str | None, batch_size: int = 64) -> HostReads:
    """The reads of a warm ``PerClassGradScaler.step_batch`` on ``batch_size`` samples of model
    ``name`` (SGD, fp32): the batch is device data, ``to_host`` and ``read_back`` one read each,
    the model's own forward counted apart."""
    model = MODELS[name](num_classes)
    inputs, labels = probe(name, num_classes)
    take = slice(0, batch_size)
    inputs = {k: v[take] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[take]
    labels = labels[take]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = PerClassGradScaler()
    with routes_as(routes) if routes else contextlib.nullcontext():
        scaler.step_batch(model, inputs, labels, opt, num_classes=num_classes)  # the forward check, once
        reads = HostReads(model)
        reads.mark(inputs, labels)
        reads.on_device(host_device, "to_device").read_point(host_device, "read_back")
        reads.read_point(host_device, "to_host").within(model, "forward")
        with reads:
            scaler.step_batch(model, inputs, labels, opt, num_classes=num_classes)
    return reads
