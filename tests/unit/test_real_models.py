"""The models users bring (issue 16's table), through ``per_class_gradients`` with no wrapper.

Each model is used as its library defines it (Hugging Face classes take dict batches as keyword
arguments and return a ``ModelOutput``): rows within 1e-5 relative of the float64 reference in
fp32 (and with the engine tests' tolerances in fp16/bf16), the hook path kept (no path given up),
and the row layout named by the model's own parameter names.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from classgrad import per_class_gradients
from classgrad.workers.engines.partitioned import hook_plan
from classgrad.workers.gradients import build_engine
from tests.support.engine_cases import fell_back, max_relative_error
from tests.support.hf_models import REAL_MODELS, hf_probe

C = 7
# fp32 rows against the float64 reference: float32 roundoff over two-layer models.
TOL = 1e-5
# The engines' low-precision bounds (about 20 unit roundoffs of the half type over these models).
HALF_TOL = {"fp16": 1e-2, "bf16": 1e-1}
# Other small configs of the same architectures (more heads and layers, grouped KV heads, OPT's
# projections in and out of narrower embeddings, a bidirectional two-layer LSTM, wider images).
OTHER_CONFIGS = {
    "bert": {"hidden_size": 24, "num_attention_heads": 3, "num_hidden_layers": 1, "intermediate_size": 32},
    "gpt2": {"n_embd": 24, "n_head": 3, "n_layer": 3},
    "llama": {"hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 20},
    "opt": {"hidden_size": 24, "num_attention_heads": 3, "word_embed_proj_dim": 12, "do_layer_norm_before": False},
    "vit": {"hidden_size": 12, "num_attention_heads": 3, "patch_size": 2},
    "resnet": {"embedding_size": 6, "hidden_sizes": [6, 10, 12], "depths": [1, 2, 1]},
    "lstm": {"layers": 2, "bidirectional": True},
    "ln_mlp": {"hidden": 17},
}


# Every test measures and spot-checks anew (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_choices")


def _reference(model, data) -> torch.Tensor:
    ref = build_engine(copy.deepcopy(model).double(), data, num_classes=C, engine="reference")
    return ref.compute(range(C)).rows


def _engine_rows(model, data, precision: str = "fp32"):
    eng = build_engine(model, data, num_classes=C, batch_size=16, precision=precision)
    return eng, eng.compute(range(C)).rows


@pytest.mark.parametrize("sizes", ["default", "other"])
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_real_models_match_the_reference_without_a_wrapper(name, sizes):
    model = REAL_MODELS[name](C, **(OTHER_CONFIGS[name] if sizes == "other" else {}))
    data = hf_probe(name, C, per_class=3, seed=1)
    got = per_class_gradients(model, data, num_classes=C, batch_size=16, progress=False)
    assert max_relative_error(got, _reference(model, data)) <= TOL
    eng, _ = _engine_rows(model, data)
    assert eng.name == "partitioned" and eng._hooked is not None and not fell_back(eng), eng.stats.notes
    # The model's own parameter names, in its own order: no wrapper prefix.
    assert [s.name for s in eng.layout.slots] == [n for n, p in model.named_parameters() if p.requires_grad]


def _lstm_runs_under_cpu_autocast(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN has an LSTM kernel under ``torch.autocast`` in ``dtype`` (an
    AMD EPYC without AVX-512 has none for bf16: "could not create a primitive descriptor")."""
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.nn.LSTM(4, 4, batch_first=True)(torch.randn(1, 2, 4))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("name,precision", [("bert", "bf16"), ("gpt2", "fp16"), ("resnet", "fp16"), ("lstm", "bf16")])
def test_real_models_in_half_precision(name, precision):
    model = REAL_MODELS[name](C)
    data = hf_probe(name, C, per_class=4, seed=2)
    if name == "lstm" and not _lstm_runs_under_cpu_autocast(torch.bfloat16):
        # No such kernel on this machine: the model's own forward fails, and so must the job
        # (an error, never rows from another precision).
        with pytest.raises(RuntimeError, match="primitive descriptor"):
            _engine_rows(model, data, precision)
        return
    eng, got = _engine_rows(model, data, precision)
    assert not fell_back(eng), eng.stats.notes
    assert max_relative_error(got, _reference(model, data)) <= HALF_TOL[precision]


def test_a_model_from_a_config_in_train_mode_gives_eval_rows_by_default():
    """A Hugging Face model fresh from its config is in train mode (dropout on): rows come in
    eval mode unless asked, and the model is left in its own mode."""
    model = REAL_MODELS["bert"](C, hidden_dropout_prob=0.3).train()
    data = hf_probe("bert", C, per_class=2, seed=3)
    got = per_class_gradients(model, data, num_classes=C, progress=False)
    assert model.training
    assert max_relative_error(got, _reference(model.eval(), data)) <= TOL


@pytest.mark.parametrize("name", ["bert", "lstm"])
def test_real_models_without_the_hook_path_take_the_other_paths_exactly(name):
    """With the hook path ruled out, a Hugging Face model with an attention mask (vmap cannot
    batch it) and a recurrent model still give the reference rows, by vmap or the last resort."""
    model = REAL_MODELS[name](C)
    data = hf_probe(name, C, per_class=3, seed=4)
    with mock.patch.object(hook_plan.HookPlan, "plan", classmethod(lambda cls, *a, **kw: None)):
        eng, got = _engine_rows(model, data)
    assert eng._hooked is None and any("loop" in n or "vmap" in n for n in eng.stats.notes), eng.stats.notes
    assert max_relative_error(got, _reference(model, data)) <= TOL
