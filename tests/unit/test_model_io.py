"""How the model is called (``classgrad.workers.model_io``): dict batches as keyword arguments,
logits out of a ``ModelOutput``, dict or tuple, class names from ``config.id2label``, and the
one-line errors of bad inputs on these paths (no tensor to take, a model on another device, a
GPT-2-style model without a pad token)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from classgrad.errors import InputError
from classgrad.workers.gradients import per_class_gradients
from classgrad.workers.model_io import ModelIO, class_names_of, is_device_mismatch, is_missing_pad_token, logits_of
from tests.support import hf_jobs


def test_logits_are_taken_from_any_output_kind():
    logits, other = torch.randn(3, 4), torch.randn(3, 2)
    assert logits_of(logits) is logits
    assert logits_of(SequenceClassifierOutput(logits=logits)) is logits
    assert logits_of({"hidden": other, "logits": logits}) is logits
    assert logits_of(("no tensor", logits, other)) is logits  # the first tensor
    assert logits_of((other, logits), output=1) is logits
    assert logits_of({"a": other, "b": logits}, output="b") is logits
    assert logits_of({"a": other, "b": logits}, output=1) is logits  # an index into a dict's values
    assert logits_of(SequenceClassifierOutput(logits=logits, hidden_states=(other,)), output="logits") is logits


@pytest.mark.parametrize(
    "out,output,message",
    [
        (("text", None), None, "model output: a tuple with no tensor to take as the logits"),
        ({"loss": None}, None, "model output: a dict with no tensor to take"),
        ((torch.zeros(1),), 3, "model.output 3: the model's output .tuple. has no such entry"),
        ({"a": "text"}, "a", "model.output 'a': that entry of the model's output is str, not a tensor"),
    ],
)
def test_an_output_with_no_tensor_to_take_is_one_line(out, output, message):
    with pytest.raises(InputError, match=message):
        logits_of(out, output)


class Kw(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids.float() * (1 if attention_mask is None else attention_mask)


class AnyKw(nn.Module):
    def forward(self, **kwargs):
        return sum(v.float() for v in kwargs.values())


def test_dict_batches_pass_only_the_keys_forward_takes_with_one_note(caplog):
    batch = {"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3), "text": ["a", "b"]}
    io = ModelIO(Kw())
    with caplog.at_level(logging.INFO, logger="classgrad.workers.model_io"):
        args, kwargs = io.arguments(batch)
        io.arguments(batch)
    assert args == () and sorted(kwargs) == ["attention_mask", "input_ids"]
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "text are not arguments of Kw.forward" in notes[0]
    # **kwargs takes every tensor; raw text never goes to it (HF forwards take **kwargs).
    assert sorted(ModelIO(AnyKw()).arguments(batch)[1]) == ["attention_mask", "input_ids"]
    assert ModelIO(Kw()).arguments(torch.ones(2))[0][0].shape == (2,)  # anything else: one positional argument
    # A dict none of whose keys forward names is the one positional argument, as before.
    assert ModelIO(Kw()).arguments({"text": ["a"]}) == (({"text": ["a"]},), {})


def test_a_model_that_takes_use_cache_is_called_without_a_cache_unless_the_batch_asks():
    """Rows need no key/value cache, and a cache is state a layer's unit would change by running
    the layer again (see ``model_io.NO_CACHE``)."""

    class Decoder(nn.Module):
        def forward(self, input_ids: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
            self.seen = use_cache
            return input_ids.float()

    model, ids = Decoder(), torch.ones(2, 3, dtype=torch.long)
    io = ModelIO(model)
    for batch, want in [(ids, False), ({"input_ids": ids}, False), ({"input_ids": ids, "use_cache": True}, True)]:
        io(batch)
        assert model.seen is want
    plain = ModelIO(nn.Identity())
    assert plain.arguments({"input": ids})[1] == {"input": ids}  # forward takes no use_cache: nothing added


def test_class_names_come_from_a_real_id2label_only():
    assert class_names_of(hf_jobs.job_bert(3, names=True), 3) == ("class-0", "class-1", "class-2")
    assert class_names_of(hf_jobs.job_bert(3), 3) is None  # LABEL_0.. placeholders
    assert class_names_of(hf_jobs.job_bert(3, names=True), 4) is None  # not one name per class
    assert class_names_of(nn.Linear(2, 3), 3) is None


# --- whole rows through per_class_gradients, against the float64 reference ----------------------


def reference(model: nn.Module, data, num_classes: int, **options) -> torch.Tensor:
    return per_class_gradients(model.double(), data, num_classes=num_classes, engine="reference", **options)


# fp32 rows against the float64 reference: the engine contract for fp32 (tests/unit/test_engines.py)
# is 1e-6; transformer rows sum over more terms (attention, layer norm) and get 1e-5.
FP32_RTOL = 1e-5


@pytest.mark.parametrize("engine", ["auto", "partitioned", "dense"])
def test_bert_on_padded_dict_samples_matches_the_reference(engine):
    from tests.support.engine_cases import max_relative_error

    C = 4
    data = hf_jobs.job_text_rows(C, per_class=3, seed=2)
    rows = per_class_gradients(hf_jobs.job_bert(C), data, num_classes=C, collate="pad", batch_size=5, engine=engine)
    ref = reference(hf_jobs.job_bert(C), data, C, collate="pad")
    assert max_relative_error(rows, ref) <= FP32_RTOL


def test_a_dataloader_and_a_hf_style_dataset_give_the_same_rows_as_the_dataset():
    from tests.support.engine_cases import max_relative_error

    C = 4
    model = hf_jobs.job_bert(C)
    base = per_class_gradients(model, hf_jobs.job_text_rows(C, 3, seed=2), num_classes=C, collate="pad")
    # The loader shuffles and batches by 3: neither is used, its dataset and collate_fn are.
    loader = per_class_gradients(model, hf_jobs.job_text_loader(C, 3, seed=2), num_classes=C)
    hf_rows = per_class_gradients(model, hf_jobs.job_hf_rows(C, 3, seed=2), num_classes=C, collate="pad")
    # The same samples padded per batch the same way: the same forward, the same rows up to the
    # order of float32 sums (batch composition does not change which rows the engine computes).
    assert max_relative_error(loader, base) <= FP32_RTOL
    assert max_relative_error(hf_rows, base) <= FP32_RTOL


@pytest.mark.parametrize("factory,output", [(hf_jobs.job_tuple_mlp, 1), (hf_jobs.job_output_mlp, None)])
def test_tuple_and_model_output_models_take_keyword_inputs(factory, output):
    from tests.support.engine_cases import max_relative_error

    C = 6
    data = hf_jobs.job_vector_rows(C, per_class=3)
    rows = per_class_gradients(factory(C), data, num_classes=C, output=output, batch_size=4)
    ref = reference(factory(C), data, C, output=output)
    assert max_relative_error(rows, ref) <= 1e-6  # fp32 vs float64 on an MLP: the engine contract


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_bf16_on_a_hf_model_matches_the_reference_within_the_engine_tolerance(mode):
    """In train mode (dropout in the attention) torch.func's VJP of the attention fails under
    bf16 autocast ("expected scalar type BFloat16 but found Float"): the dense engine finds that
    out on its first graph and uses autograd. Both engines draw the same dropout masks (the same
    seed per micro-batch), so the rows still match the reference's."""
    from tests.support.engine_cases import max_relative_error

    C = 4
    data = hf_jobs.job_text_rows(C, per_class=8, seed=2)
    options = {"collate": "pad", "mode": mode, "batch_size": 64}
    rows = per_class_gradients(hf_jobs.job_bert(C), data, num_classes=C, precision="bf16", **options)
    ref = reference(hf_jobs.job_bert(C), data, C, **options)
    assert bool(torch.isfinite(rows).all())
    # bf16 bound of the engines (tests/support/engine_cases.LOW_PRECISION_TOLERANCE, about 25 unit roundoffs).
    assert max_relative_error(rows, ref) <= 1e-1


def test_a_gpt2_style_model_without_a_pad_token_is_refused_in_one_line():
    C = 3
    data = hf_jobs.job_text_rows(C, per_class=2, seed=2)
    with pytest.raises(InputError, match="config.pad_token_id is not set"):
        per_class_gradients(hf_jobs.job_gpt2(C), data, num_classes=C, collate="pad")
    rows = per_class_gradients(hf_jobs.job_gpt2(C, pad_token=True), data, num_classes=C, collate="pad")
    assert rows.shape[0] == C and bool(torch.isfinite(rows).all())


class OffDevice(nn.Module):
    """Uses a plain tensor attribute (not a buffer) that ``model.to`` does not move."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = torch.ones(2, device="meta")

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_model_on_another_device_than_asked_for_is_one_line():
    data = (torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    with pytest.raises(InputError, match="model: its forward uses tensors on another device than engine.device 'cpu'"):
        per_class_gradients(OffDevice(), data, num_classes=2)
    with pytest.raises(InputError, match="model: cannot be moved to engine.device 'cpu'"):
        per_class_gradients(nn.Linear(3, 2, device="meta"), data, num_classes=2)


def test_device_mismatches_and_a_missing_pad_token_are_told_by_their_text():
    with pytest.raises(RuntimeError) as raised:
        OffDevice()(torch.randn(4, 3))  # torch's own refusal: a cpu tensor times a meta one
    assert is_device_mismatch(raised.value)
    cuda = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
    assert is_device_mismatch(RuntimeError(cuda))
    with pytest.raises(RuntimeError) as other:
        torch.ones(2, 3) @ torch.ones(2, 3)  # a shape error: the user's model, said as it is
    assert not is_device_mismatch(other.value)
    assert not is_device_mismatch(ValueError(cuda))  # only PyTorch's RuntimeError
    pad = ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")  # transformers' words
    assert is_missing_pad_token(pad)
    assert not is_missing_pad_token(ValueError("too many values to unpack"))
    assert not is_missing_pad_token(RuntimeError(str(pad)))


def test_parameter_names_are_the_models_own():
    from classgrad.workers.gradients import build_engine

    eng = build_engine(hf_jobs.job_bert(3), hf_jobs.job_text_rows(3, 1, seed=0), num_classes=3, collate="pad")
    assert "classifier.weight" in eng.layout.names and "bert.embeddings.word_embeddings.weight" in eng.layout.names


def test_bad_dict_inputs_through_per_class_gradients_are_one_line():
    C = 3
    with pytest.raises(InputError, match="model output: a dict with no tensor to take as the logits"):
        per_class_gradients(hf_jobs.job_no_tensor_output(C), hf_jobs.job_vector_rows(C), num_classes=C)
    with pytest.raises(InputError, match=r"data: item 4 has no label key 'labels' \(it has: features, note\)"):
        per_class_gradients(hf_jobs.job_tuple_mlp(C), hf_jobs.job_rows_missing_label(C), num_classes=C)


@pytest.mark.parametrize("names", [True, False])
def test_the_job_check_records_id2label_as_the_stores_class_names(tmp_path, names):
    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.preparation import check_job

    C = 3
    config = JobConfig.model_validate(
        {
            "model": {"factory": "tests.support.hf_jobs:job_bert", "kwargs": {"num_classes": C, "names": names}},
            "data": {"factory": "tests.support.hf_jobs:job_text_rows", "kwargs": {"num_classes": C}, "collate": "pad"},
            "loss": {"num_classes": C},
            "store": {"url": str(tmp_path / "s.zarr")},
        }
    )
    spec = check_job(config).spec
    assert spec.class_names == (("class-0", "class-1", "class-2") if names else None)
    assert "classifier.weight" in [slot.name for slot in spec.layout]


# --- padding: input_ids padded with the model's pad id ------------------------------------------

PAD_ID = 47  # the tiny models' last token id (vocabulary 48), which no probe sample holds: an eos id


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_padded_batches_give_the_rows_of_one_sample_at_a_time(name):
    """A pad id other than 0 (GPT-2's recipe: the eos id): ``collate="pad"`` pads input_ids with
    it, so a GPT-2/Llama model finds each sample's last real token in a padded batch too."""
    from tests.support.engine_cases import max_relative_error
    from tests.support.hf_models import HF_BUILDERS

    C = 4
    model = HF_BUILDERS[name](C, pad_token_id=PAD_ID)
    data = hf_jobs.job_text_rows(C, per_class=3, seed=2)  # 3 to 9 tokens, ids below 40
    padded = per_class_gradients(model, data, num_classes=C, collate="pad", batch_size=len(data))
    one = per_class_gradients(model, data, num_classes=C, collate="pad", batch_size=1)
    # The same forward per sample, summed in another order over other batches: fp32 roundoff of
    # transformer rows (FP32_RTOL). Padded with 0, GPT-2 and Llama rows differ by about 0.3.
    assert max_relative_error(padded, one) <= FP32_RTOL


class Tokenizer:
    def __init__(self, pad_token_id):
        self.pad_token_id = pad_token_id


def test_the_pad_id_of_input_ids_comes_from_the_tokenizer_or_the_model_and_another_is_refused():
    from classgrad.workers.model_io import input_pad_values

    gpt = hf_jobs.job_gpt2(3)
    gpt.config.pad_token_id = 7
    assert input_pad_values(gpt, "pad") == {"input_ids": 7}
    assert input_pad_values(gpt, "pad", {"attention_mask": 0}, Tokenizer(7)) == {"attention_mask": 0, "input_ids": 7}
    assert input_pad_values(gpt, "stack", {"x": 1}) == {"x": 1}  # not padded by classgrad: as given
    assert input_pad_values(nn.Linear(2, 2), "pad", None, Tokenizer(5)) == {"input_ids": 5}  # no model pad id
    assert input_pad_values(hf_jobs.job_gpt2(3), "pad") == {}  # no pad id anywhere (refused when called)
    with pytest.raises(InputError, match=r"input_ids would be padded with 0 \(data.pad_values.input_ids\) but the "):
        input_pad_values(gpt, "pad", {"input_ids": 0})
    with pytest.raises(InputError, match=r"padded with 9 \(the tokenizer's pad_token_id\) .* config.pad_token_id is 7"):
        per_class_gradients(
            gpt, hf_jobs.job_text_rows(3, 1, seed=0), num_classes=3, collate="pad", tokenizer=Tokenizer(9)
        )


def test_a_jobs_probe_pads_input_ids_with_the_models_pad_id():
    from classgrad.config import JobConfig
    from classgrad.workers.actor_runtime.factory import build_job_engine

    C = 3
    config = JobConfig.model_validate(
        {
            "model": {
                "factory": "tests.support.hf_models:tiny_gpt2",
                "kwargs": {"num_classes": C, "pad_token_id": PAD_ID},
            },
            "data": {"factory": "tests.support.hf_jobs:job_text_rows", "kwargs": {"num_classes": C}, "collate": "pad"},
            "loss": {"num_classes": C},
        }
    )
    engine = build_job_engine(config, device="cpu")
    x, _ = engine.probe.batch(torch.arange(len(engine.probe)), torch.device("cpu"))
    hidden = x["attention_mask"] == 0
    assert bool(hidden.any()) and bool((x["input_ids"][hidden] == PAD_ID).all())
