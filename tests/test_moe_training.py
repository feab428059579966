"""Mixture-of-experts models trained the way users train them: a tiny Mixtral under `Trainer(plugins=FP8Precision())`
with a real ModelCheckpoint and a resume, the callbacks watching and moving experts, a Qwen3-MoE under transformers'
Trainer with FP8 requested for the process (the launcher's `enable_fp8`). The loss curves beside bf16-mixed:
benchmarks/moe.py (benchmarks/results/moe.md)."""
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from support.hf_models import CountFP8Gemms, HFModule
from support.moe_models import moe_model, token_batches

from lightning_fp8 import FP8Layer, FP8Precision, fp8_state_dict, precision_map
from lightning_fp8.callbacks import FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.modules.grouped_linear import FP8GroupedLinear

pytestmark = pytest.mark.filterwarnings("ignore::lightning_fp8.modules.gemm.FP8EmulationWarning")

STEPS = 6


def _trainer(tmp_path, callbacks=(), max_steps=STEPS, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   plugins=[FP8Precision()], callbacks=list(callbacks), default_root_dir=tmp_path)
    return L.Trainer(**{**options, **kwargs})


def _loader():
    """An epoch of 3 batches: the checkpoint at step 3 is an epoch's end, where a resume starts the next epoch."""
    return torch.utils.data.DataLoader(token_batches(3), batch_size=None)


def test_a_tiny_mixtral_trains_in_fp8_and_resumes_bit_identically(tmp_path):
    module = HFModule(moe_model("mixtral"), lr=3e-3)
    gemms = CountFP8Gemms()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path, [checkpoint, gemms.during_first_step()], enable_checkpointing=True).fit(module, _loader())
    fp8_layers = [m for m in module.modules() if isinstance(m, FP8Layer) and m.fp8_enabled]
    experts = [m for m in fp8_layers if isinstance(m, FP8GroupedLinear)]
    assert len(experts) == 4 and len(fp8_layers) == 9
    # every layer's three GEMMs, the experts' grouped ones included, in the first step of each of the 2 epochs
    assert gemms.count == 2 * 3 * len(fp8_layers)
    assert all(layer.fp8_meta.amax_history[:, 1:].gt(0).any(dim=1).all() for layer in experts)  # closed by the engine
    assert all(loss == loss for loss in module.losses)

    resumed = HFModule(moe_model("mixtral", seed=1), lr=3e-3)
    path = next(p for p in (tmp_path / "ckpt").iterdir() if "step=3" in p.name)
    _trainer(tmp_path).fit(resumed, _loader(), ckpt_path=path)
    assert resumed.losses == module.losses[3:]
    for key, value in fp8_state_dict(module).items():
        assert torch.equal(fp8_state_dict(resumed)[key], value), key
    for (name, p), q in zip(module.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_the_callbacks_watch_experts_and_fallback_moves_one_projection(tmp_path):
    module = HFModule(moe_model("mixtral"), lr=3e-3)
    monitor = FP8ScaleMonitor(log_every_n_steps=1)
    fallback = FP8LayerFallback(keep_in_bf16=["*.layers.1.mlp.experts.down"])
    trainer = _trainer(tmp_path, [monitor, fallback], logger=CSVLogger(tmp_path, name="run"))
    trainer.fit(module, _loader())
    rows = {row.fqn: row for row in precision_map(module)}
    down = rows["model.model.layers.1.mlp.experts.down"]
    assert down.precision == "bf16" and "FP8LayerFallback" in down.reason
    assert rows["model.model.layers.1.mlp.experts.gate_up"].precision == "fp8"
    with open(tmp_path / "run" / "version_0" / "fp8_history.jsonl") as f:
        records = [json.loads(line) for line in f]
    watched = {layer for record in records if record["type"] == "stats" for layer in record.get("layers", {})}
    assert "model.model.layers.0.mlp.experts.gate_up" in watched and "model.model.layers.0.mlp.experts.down" in watched


@pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py
def test_transformers_trainer_trains_a_moe_model_with_fp8_experts(tmp_path):
    from transformers import Trainer, TrainingArguments

    from lightning_fp8.accelerate import enable_fp8
    from lightning_fp8.integrations.accelerate import plain

    enable_fp8()
    try:
        model = moe_model("qwen3_moe")
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                                 use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=3e-3)
        examples = [{"input_ids": b["input_ids"][0], "labels": b["labels"][0]} for b in token_batches(12, batch_size=1)]
        hf_trainer = Trainer(model=model, args=args, train_dataset=examples)
        with CountFP8Gemms() as gemms:
            hf_trainer.train()
    finally:
        plain.uninstall()
    experts = [m for m in model.modules() if isinstance(m, FP8GroupedLinear)]
    assert len(experts) == 4 and all(layer.fp8_enabled for layer in experts)
    assert gemms.count == 3 * 3 * 9  # 3 steps x (5 linear + 4 experts' grouped) layers x 3 GEMMs
    assert hf_trainer.accelerator.fp8_engine.step_count == 3
