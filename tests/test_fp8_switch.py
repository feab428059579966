"""`fp8_autocast(enabled=False)` turns FP8 off for every forward inside it, the forwards of models the adapters
prepared included: the Lightning Trainer's evaluation loops, a Fabric-set-up model, a model Accelerate or
transformers' Trainer prepared. (Their own FP8 context used to turn FP8 back on inside the block.)

Each test counts the FP8 GEMMs (`lightning_fp8::fp8_gemm` calls) of one evaluation with and without the block.
"""
import lightning as L
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Precision, fp8_autocast, fp8_layers
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from tests.support.helpers import DispatchCount, RegressionModule, loader, mlp, trainer

pytestmark = pytest.mark.filterwarnings("ignore::lightning_fp8.modules.gemm.FP8EmulationWarning")


def _fp8_gemms(run) -> int:
    with DispatchCount() as count:
        run()
    return count.of("lightning_fp8.fp8_gemm")


def _on_and_off(run):
    """FP8 GEMMs of `run()` as it is and inside fp8_autocast(enabled=False)."""
    on = _fp8_gemms(run)

    def off_run():
        with fp8_autocast(enabled=False):
            run()

    return on, _fp8_gemms(off_run)


def test_lightning_evaluation_loops_honour_the_switch():
    module = RegressionModule()
    fit_trainer = trainer(plugins=[FP8Precision()], max_steps=2)
    fit_trainer.fit(module, loader())
    on, off = _on_and_off(lambda: fit_trainer.validate(module, loader(n=32), verbose=False))
    assert on > 0 and off == 0
    on, off = _on_and_off(lambda: fit_trainer.predict(module, loader(n=32)))
    assert on > 0 and off == 0


def test_a_fabric_model_honours_the_switch():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()])
    torch.manual_seed(0)
    model = fabric.setup_module(mlp())
    model.eval()
    x = torch.randn(8, 32)
    on, off = _on_and_off(lambda: model(x))
    assert on > 0 and off == 0
    model.train()
    on, off = _on_and_off(lambda: fabric.backward(model(x).sum()))
    assert on > 0 and off == 0


@pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py
def test_an_accelerate_model_honours_the_switch():
    from lightning_fp8.accelerate import FP8Accelerator

    accelerator = FP8Accelerator(mixed_precision="fp8", cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(mlp())
    model.eval()
    x = torch.randn(8, 32)
    on, off = _on_and_off(lambda: model(x))
    assert on > 0 and off == 0


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_transformers_trainer_model_honours_the_switch(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from lightning_fp8.accelerate import enable_fp8
    from lightning_fp8.integrations.accelerate import plain

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 32, (16, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    enable_fp8()
    try:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2))
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                                 use_cpu=True, save_strategy="no", disable_tqdm=True)
        hf_trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        hf_trainer.train()
        assert fp8_layers(hf_trainer.model)
        hf_trainer.model.eval()
        x = Tokens.ids[:2]
        on, off = _on_and_off(lambda: hf_trainer.model(input_ids=x))
        assert on > 0 and off == 0
    finally:
        plain.uninstall()


def test_the_adapters_own_switch_still_turns_fp8_off_inside_an_enabled_block():
    """fp8_eval=False evaluates in the compute dtype even inside fp8_autocast(enabled=True)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(fp8_eval=False)])
    model = fabric.setup_module(mlp())
    model.eval()

    def run():
        with fp8_autocast(enabled=True):
            model(torch.randn(4, 32))

    assert _fp8_gemms(run) == 0
