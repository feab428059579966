"""Unchanged Accelerate and transformers Trainer scripts in FP8 (docs/accelerate.md, "Unchanged scripts"):

- every `accelerate.Accelerator` built once FP8 is requested is an FP8Accelerator (`enable_fp8()`, or each process
  of `python -m lightning_fp8.accelerate launch --mixed_precision fp8`), transformers' Trainer's included;
- Trainer checkpoints carry the FP8 state (scaler.pt) and a resume continues bit for bit;
- an explicit precision that overrules the FP8 request says so at the first prepare.

The launcher runs of the examples (1 and 2 CPU processes) are in tests/test_examples.py.
"""
import os
import warnings

import accelerate
import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import AORecipeKwargs
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lightning_fp8 import fp8_layers, fp8_state_dict
from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs, enable_fp8
from lightning_fp8.integrations.accelerate import plain

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py


@pytest.fixture(autouse=True)
def no_hook_left_behind():
    yield
    plain.uninstall()


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, block=16, vocab=32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, block), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _args(out, **kwargs):
    defaults = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                    logging_steps=1, save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                    dataloader_num_workers=0, lr_scheduler_type="linear")
    defaults.update(kwargs)
    return TrainingArguments(**defaults)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_plain_accelerators_run_fp8_once_requested(monkeypatch):
    enable_fp8(FP8Kwargs(snapshot_every=7))
    accelerator = accelerate.Accelerator(cpu=True)  # the class a script (or transformers) names
    assert type(accelerator) is FP8Accelerator and accelerator.mixed_precision == "fp8"
    assert accelerator.fp8_engine.config.snapshot_every == 7  # enable_fp8's options
    AcceleratorState._reset_state(True)

    class MyAccelerator(accelerate.Accelerator):
        pass

    mine = MyAccelerator(cpu=True)
    assert isinstance(mine, MyAccelerator) and type(mine).__name__ == "FP8MyAccelerator" and mine.fp8_engine
    AcceleratorState._reset_state(True)
    import accelerate.utils.dataclasses as accelerate_dataclasses

    monkeypatch.setattr(accelerate_dataclasses, "is_torchao_available", lambda: True)
    torchao_recipe = AORecipeKwargs(config=object())  # a script asking for Accelerate's torchao backend
    with pytest.warns(UserWarning, match="AORecipeKwargs, which configures one of Accelerate's own FP8 backends"):
        with pytest.raises(Exception):  # torchao is not really installed: Accelerate's own backend then fails
            accelerate.Accelerator(cpu=True, kwargs_handlers=[torchao_recipe])


def test_hf_trainer_trains_in_fp8_with_one_line_and_resumes_bit_for_bit(tmp_path):
    """transformers' Trainer builds Accelerator(**args) itself: with enable_fp8() it is an FP8Accelerator. Its
    checkpoints carry the engine state and every layer's FP8 metadata (scaler.pt, where the Trainer saves
    `accelerator.scaler`), so a resumed run continues exactly as the uninterrupted one."""
    enable_fp8()
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path / "full"), train_dataset=_Tokens())
    assert type(trainer.accelerator) is FP8Accelerator and trainer.args.mixed_precision == "fp8"
    trainer.train()
    assert len(fp8_layers(trainer.model)) == 7  # 8 Conv1D and lm_head: the first (c_attn of h.0) and last stay BF16
    full_losses, full_fp8 = _losses(trainer), fp8_state_dict(trainer.model)
    full_weights = [p.detach().clone() for p in trainer.model.parameters()]
    saved = torch.load(tmp_path / "full" / "checkpoint-3" / "scaler.pt", weights_only=True)
    assert saved["format"] == "lightning_fp8.accelerate/1" and saved["engine"]["step_count"] == 3
    assert saved["fp8_meta"] and all(torch.isfinite(v).all() for v in saved["fp8_meta"].values())

    AcceleratorState._reset_state(True)
    resumed = Trainer(model=_gpt2(), args=_args(tmp_path / "full"), train_dataset=_Tokens())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert _losses(resumed) == full_losses  # steps 1-3 from the checkpoint's log, 4-6 trained again
    for key, value in fp8_state_dict(resumed.model).items():
        assert torch.equal(value, full_fp8[key]), key
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full_weights))


def test_an_explicit_precision_that_overrules_fp8_says_so_at_the_first_prepare(tmp_path, monkeypatch):
    """`--mixed_precision fp8` with transformers' `--bf16` (TrainingArguments(bf16=True)): the explicit argument wins,
    as in Accelerate, and the run says so instead of training in BF16 silently."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # what the launcher sets in each process
    plain.install()
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, bf16=True, max_steps=1, save_strategy="no"),
                      train_dataset=_Tokens())
    assert trainer.accelerator.mixed_precision == "bf16"
    with pytest.warns(UserWarning, match=r"built with mixed_precision='bf16' explicitly .*--bf16.* this run trains in "
                                         r"'bf16', NOT in FP8"):
        trainer.train()
    assert not fp8_layers(trainer.model)


def test_enable_fp8_keeps_a_launch_that_asks_for_bf16(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.warns(UserWarning, match="ACCELERATE_MIXED_PRECISION=bf16 .* is kept: this run trains in bf16"):
        enable_fp8()
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing overruled FP8 here: the launch asked for bf16, no second warning
        accelerator = accelerate.Accelerator(cpu=True)
        accelerator.prepare(torch.nn.Linear(16, 16))
    assert accelerator.mixed_precision == "bf16" and accelerator.fp8_engine is None
