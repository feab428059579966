"""Run by tests/test_lightning_examples.py: Lightning's and Fabric's own tensor-parallel example (its model,
`parallelize` and data copied unchanged into tests/support/lightning_tp_example/), with the FP8 plugin added and CPU
settings only, and the model-built-inside-configure_model form; every scenario of one rank count in ONE launch.

    python tests/workers/lightning_examples_worker.py OUT_DIR NPROC [scenario ...]   # forks NPROC ranks
    python -m torch.distributed.run --nproc_per_node NPROC tests/workers/lightning_examples_worker.py OUT_DIR NPROC

NPROC 2: `lightning_tp_loss_parallel` (TP=2 with loss_parallel), `lightning_built_in_configure_model` (FSDP2 over 2
ranks, the model built and sharded inside configure_model), `fabric_fsdp_example_layout` (the example's parallelize
over 2 data-parallel ranks: FSDP2 with reshard_after_forward=False for the last block). NPROC 4:
`lightning_2d_example` (the example as shipped: FSDP2 x TP, 2 x 2, torch's plain styles, loss_parallel).
Each scenario writes OUT_DIR/<scenario>.rank<r>.pt (or .error).

What changed in the example besides the plugin: CPU settings (accelerator="cpu", the device count and mesh sizes of
the launch, a tiny ModelArgs: the shipped one is a 7 B model, 16-token sequences, batch size 4, num_workers=0; no
logger, checkpointing or progress bar) and a learnable signal for a 6-step run: the example's random tokens are
learnable only by memorizing them, so every step reads the same first batch (one batch per epoch, 6 epochs, and
`use_distributed_sampler=False`: Lightning's sampler would shuffle them anew each epoch) and the loss must fall.
"""
import os
import sys
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # for `support`
sys.path.insert(0, os.path.join(TESTS, "support", "lightning_tp_example"))  # the example's own imports (`from model`)
from data import RandomTokenDataset  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from parallelism import parallelize  # noqa: E402
from support.parallel_training import full_weights, run_scenarios  # noqa: E402
from support.torchrun_launch import launch_forked  # noqa: E402

from lightning_fp8 import FP8Precision, fp8_layers, fp8_state_dict, precision_map  # noqa: E402
from lightning_fp8.distributed import fp8_all_gather_reason, uses_fp8_all_gather  # noqa: E402
from lightning_fp8.modules.gathered_fp8 import GatheredFP8Weight  # noqa: E402

OUT = sys.argv[1]
NPROC = int(sys.argv[2]) if len(sys.argv) > 2 else 2
#: the example's ModelArgs(vocab_size=32000) at CPU size (dimensions multiples of 16, as FP8 GEMMs need)
ARGS = dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, multiple_of=32, max_seq_len=32)
SEQ_LENGTH, BATCH_SIZE, BATCHES, EPOCHS = 16, 4, 1, 6
SUMMARY = "linear layers run in FP8"  # the first line of the conversion summary


def plain(loss: torch.Tensor) -> float:
    return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())


class Logged:
    """What the plugins log through Lightning's rank-zero functions, on every rank (the messages are decided on every
    rank; only rank 0 prints them)."""

    def __enter__(self):
        from lightning.fabric.utilities import rank_zero

        self.module, self.info, self.warn = rank_zero, rank_zero.rank_zero_info, rank_zero.rank_zero_warn
        self.messages, self.warnings = [], []
        rank_zero.rank_zero_info = lambda message, *a, **k: self.messages.append(str(message))
        rank_zero.rank_zero_warn = lambda message, *a, **k: self.warnings.append(str(message))
        return self

    def __exit__(self, *exc):
        self.module.rank_zero_info, self.module.rank_zero_warn = self.info, self.warn

    def summaries(self) -> int:
        return sum(SUMMARY in m for m in self.messages)


def fp8_report(plugin, model) -> dict:
    """Which layers are FP8 layers and compute in FP8: FP8-enabled, with amaxes recorded in the completed steps of
    every role's history (input, weight, grad_output: the three GEMMs' casts ran)."""
    layers = fp8_layers(model)
    computing = [fqn for fqn, layer in layers.items()
                 if layer.fp8_enabled and bool((layer.fp8_meta.amax_history[:, 1:] > 0).any(dim=1).all())]
    return {"fp8_layers": sorted(layers), "computing_in_fp8": sorted(computing),
            "precision": {row.fqn: (row.precision, row.reason) for row in precision_map(model)},
            "fp8_all_gather": sorted(fqn for fqn, layer in layers.items() if uses_fp8_all_gather(layer)),
            "gather_reasons": {fqn: fp8_all_gather_reason(layer) for fqn, layer in layers.items()},
            "fp8": {k: v.clone() for k, v in fp8_state_dict(model).items()},
            "steps": plugin.engine.step_count, "skips": plugin.skipped_steps}


# -- Lightning's example (examples/pytorch/tensor_parallel/train.py) ----------------------------------------------
class Llama3(L.LightningModule):
    """train.py's LightningModule, unchanged but for the model size (ARGS) and the dataloader's CPU settings."""

    def __init__(self):
        super().__init__()
        self.model_args = ModelArgs(**ARGS)
        self.model = Transformer(self.model_args)

    def configure_model(self):
        # User-defined function that applies the desired parallelizations specific to the model
        # (TP, FSDP2, activation checkpointing, ...)
        parallelize(self.model, device_mesh=self.device_mesh)

    def on_train_start(self) -> None:
        self.model.init_weights()

    def training_step(self, batch):
        inputs = batch[:, :-1]
        labels = batch[:, 1:]
        output = self.model(inputs)
        # Optional: Parallelize loss computation across class dimension (see parallelism.py)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs):
        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self):
        dataset = RandomTokenDataset(vocab_size=self.model_args.vocab_size, seq_length=SEQ_LENGTH)
        # Trainer configures the sampler automatically for you such that
        # all batches in a tensor-parallel group are identical
        return DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=0)


class RecordedLlama3(Llama3):
    """The example's module, its losses recorded (the loss it returns is what Lightning and the plugin get)."""

    def __init__(self):
        super().__init__()
        self.losses, self.loss_types = [], set()

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.loss_types.add(type(loss).__name__)
        self.losses.append(plain(loss))
        return loss


def _example_run(data_parallel_size: int, tensor_parallel_size: int) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    plugin = FP8Precision()
    strategy = ModelParallelStrategy(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size)
    trainer = L.Trainer(accelerator="cpu", devices=data_parallel_size * tensor_parallel_size, strategy=strategy,
                        limit_train_batches=BATCHES, max_epochs=EPOCHS, plugins=[plugin], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    with Logged() as logged:
        with trainer.init_module(empty_init=True):
            model = RecordedLlama3()
        trainer.fit(model)
    return {"losses": model.losses, "loss_types": sorted(model.loss_types), "summaries": logged.summaries(),
            "warnings": logged.warnings, "weights": full_weights(model.model), **fp8_report(plugin, model)}


def lightning_tp_loss_parallel() -> dict:
    """The example on 2 ranks as TP=2 (its `parallelize` applies torch's ColwiseParallel / RowwiseParallel /
    SequenceParallel / PrepareModuleInput; the loss under loss_parallel() is a DTensor)."""
    return _example_run(1, 2)


def lightning_2d_example() -> dict:
    """The example as shipped, 2 x 2: TP with torch's plain styles, then activation checkpointing and fully_shard
    with a BF16 MixedPrecisionPolicy over the data-parallel dimension (the last block reshard_after_forward=False)."""
    return _example_run(2, 2)


# -- the large-model form: built and sharded inside configure_model -----------------------------------------------
class BuiltInConfigureModel(L.LightningModule):
    """Lightning's documented form for models too large to build in __init__: nothing in __init__, the model built in
    configure_model and sharded there. No lightning_fp8 line."""

    def __init__(self):
        super().__init__()
        self.model = None
        self.losses, self.output_weight = [], set()

    def configure_model(self):
        if self.model is not None:
            return
        from torch.distributed.fsdp import fully_shard

        self.model = Transformer(ModelArgs(**ARGS))
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch):
        output = self.model(batch[:, :-1])
        # the root unit is not resharded after forward: the head's weight is what its all-gather produced
        self.output_weight.add(type(self.model.output.weight).__name__)
        loss = F.cross_entropy(output.reshape(-1, output.size(-1)), batch[:, 1:].reshape(-1))
        self.losses.append(plain(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def train_dataloader(self):
        return DataLoader(RandomTokenDataset(vocab_size=ARGS["vocab_size"], seq_length=SEQ_LENGTH),
                          batch_size=BATCH_SIZE)


def lightning_built_in_configure_model() -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    plugin = FP8Precision()
    trainer = L.Trainer(accelerator="cpu", devices=2, limit_train_batches=BATCHES, max_epochs=EPOCHS,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), plugins=[plugin],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    model = BuiltInConfigureModel()
    with Logged() as logged:
        trainer.fit(model)
    return {"losses": model.losses, "summaries": logged.summaries(), "warnings": logged.warnings,
            "output_weight": sorted(model.output_weight), "weights": full_weights(model.model),
            **fp8_report(plugin, model)}


# -- Fabric's example (examples/fabric/tensor_parallel/train.py) over the data-parallel ranks ----------------------
def fabric_fsdp_example_layout() -> dict:
    """Fabric's train.py with its parallelize over 2 data-parallel ranks (tensor_parallel_size=1: the FSDP2 part of
    the example: checkpoint_wrapper, a BF16 MixedPrecisionPolicy, the last block with reshard_after_forward=False,
    the root unit, which FSDP2 never reshards after forward): whether the plugin warns that FP8 layers gather in high
    precision at the first backward, when those units hold their weights unsharded."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    plugin = FabricFP8Precision()
    with Logged() as logged:
        strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
        fabric.launch()
        model_args = ModelArgs(**ARGS)
        with fabric.init_module(empty_init=True):
            model = Transformer(model_args)
        model = fabric.setup(model)
        model.init_weights()
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True))
        dataset = RandomTokenDataset(vocab_size=model_args.vocab_size, seq_length=SEQ_LENGTH)
        dataloader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH_SIZE), use_distributed_sampler=False)
        losses, unsharded_at_backward = [], []
        for _ in range(EPOCHS):
            for i, batch in enumerate(dataloader):
                if i == BATCHES:
                    break
                inputs, labels = batch[:, :-1], batch[:, 1:]
                output = model(inputs)
                if not unsharded_at_backward:  # what the first backward's check meets
                    unsharded_at_backward = [fqn for fqn, layer in fp8_layers(model).items()
                                             if isinstance(layer.weight, GatheredFP8Weight)]
                with loss_parallel():
                    loss = F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))
                    fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(plain(loss))
    return {"losses": losses, "warnings": logged.warnings, "summaries": logged.summaries(),
            "unsharded_at_backward": unsharded_at_backward, "weights": full_weights(model.module),
            **fp8_report(plugin, model)}


SCENARIOS = {
    2: {"lightning_tp_loss_parallel": lightning_tp_loss_parallel,
        "lightning_built_in_configure_model": lightning_built_in_configure_model,
        "fabric_fsdp_example_layout": fabric_fsdp_example_layout},
    4: {"lightning_2d_example": lightning_2d_example},
}


def main() -> None:
    run_scenarios(SCENARIOS[NPROC], OUT, names=sys.argv[3:] or list(SCENARIOS[NPROC]))


if __name__ == "__main__":
    launch_forked(main, NPROC)
