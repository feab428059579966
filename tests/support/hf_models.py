"""Small Hugging Face models built from configs (no downloads) and a LightningModule that trains any of them."""
import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

VOCAB = 128


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama(layers=2):
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     vocab_size=VOCAB, num_labels=3, max_position_embeddings=32)
    return transformers.BertForSequenceClassification(config)


def t5():
    config = transformers.T5Config(num_layers=1, num_decoder_layers=1, d_model=64, d_ff=128, d_kv=16, num_heads=4,
                                   vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def vit():
    config = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    image_size=32, patch_size=8, num_labels=10)
    return transformers.ViTForImageClassification(config)


def resnet():
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    return transformers.ResNetForImageClassification(config)


def batch_for(model, batch_size=4, seq=16, seed=0):
    """A training batch (with labels) for any model above."""
    g = torch.Generator().manual_seed(seed)
    if model.main_input_name == "pixel_values":
        size = model.config.image_size if hasattr(model.config, "image_size") else 32
        return {"pixel_values": torch.randn(batch_size, 3, size, size, generator=g),
                "labels": torch.randint(0, model.config.num_labels, (batch_size,), generator=g)}
    ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
    if isinstance(model, transformers.BertForSequenceClassification):
        return {"input_ids": ids, "labels": torch.randint(0, 3, (batch_size,), generator=g)}
    return {"input_ids": ids, "labels": ids.clone()}


class HFModule(L.LightningModule):
    """Trains a Hugging Face model on its own `loss` output; the optimizer holds the trainable Parameters only."""

    def __init__(self, model, lr=1e-3):
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def fit(module, batches, plugin=None, **trainer_kwargs):
    """A real Trainer over a list of batches (one epoch), FP8Precision unless `plugin` says otherwise."""
    from lightning_fp8 import FP8Precision

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        plugins=[plugin if plugin is not None else FP8Precision()], **trainer_kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


class CountFP8Gemms(TorchDispatchMode):
    """Counts the library's FP8 GEMM op (forward and backward; each FP8 layer runs up to three per step)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.lightning_fp8.fp8_gemm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def during_first_step(self) -> L.Callback:
        """A callback that counts over the first training step only (forward, backward and optimizer step): a
        dispatch mode sees every op, which is slow."""
        mode = self

        class FirstStep(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == 0:
                    mode.__enter__()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if batch_idx == 0:
                    mode.__exit__(None, None, None)

        return FirstStep()
