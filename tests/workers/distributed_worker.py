"""Run by tests/test_distributed.py under torchrun (2 CPU ranks, gloo): every multi-process check of the FSDP2 / FP8
communication work in ONE launch (a launch costs ~10 s of imports per rank).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/distributed_worker.py OUT_DIR [scenario ...]

Each scenario writes OUT_DIR/<scenario>.rank<r>.pt (tensors, lists); the test compares ranks and runs. A scenario
that raises writes its traceback to OUT_DIR/<scenario>.rank<r>.error and the others still run (the collectives of
a failed scenario may leave the group unusable; the launch then times out and the test reports the error file).
The process group is destroyed at the end after a barrier: gloo aborts at interpreter exit otherwise.
(Length: the scenarios of every framework, Lightning / Fabric / Accelerate with FSDP2 and DDP, live in this one
script because each torchrun launch is paid once.)
"""
import math
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_fp8 import FP8Precision, fp8_state_dict  # noqa: E402
from lightning_fp8.demo.gpt import GPT, GPTConfig  # noqa: E402

OUT = sys.argv[1]
CFG = GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=2)
STEPS, CKPT_STEP = 8, 5
SKIP_STEP = 3  # rank 1's gradients are inf at this step: every rank must skip it (after the rollback: counted)
ROLLBACK_STEP = 1  # rank 0's loss is NaN at this step: every rank must roll back (before the checkpoint)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def batch(step: int, r: int):
    """The batch of (global step, rank): runs compared step by step see the same data whatever the loader does."""
    g = torch.Generator().manual_seed(1000 * step + r)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.context + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def faults(model: nn.Module, step_of) -> None:
    """A skip (rank 1's gradients inf at SKIP_STEP) and a rollback (rank 0's loss NaN at ROLLBACK_STEP)."""

    def hook(module, args, out):
        step = step_of()
        if step == SKIP_STEP and rank() == 1 and out.requires_grad:
            out.register_hook(lambda g: g * float("inf"))
        if step == ROLLBACK_STEP and rank() == 0:
            return out * float("nan")
        return out

    model.blocks[1].register_forward_hook(hook)


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / STEPS)))


class GPTModule(L.LightningModule):
    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.fsdp = fsdp
        self.losses = []
        faults(self.model, lambda: self.trainer.global_step)

    def configure_model(self) -> None:
        if not self.fsdp:
            return
        # the documented flow: convert (and install FP8 all-gather weights) before fully_shard
        self.trainer.precision_plugin.convert_for_fsdp(self.model)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, _, __):
        x, y = batch(self.trainer.global_step, rank())
        loss = self.model.loss(x, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}]


def trainer(strategy, plugin, max_steps, callbacks=()):
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], max_steps=max_steps, logger=False,
        # only a scenario's own ModelCheckpoint (a default one would write into the working directory)
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=list(callbacks), enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, gradient_clip_val=1.0, num_sanity_val_steps=0,
    )


def loader():
    return DataLoader(list(range(4 * STEPS)), batch_size=1)


def full_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).float()
                      for p in model.parameters()])


def fp8_state(plugin, module) -> dict:
    engine = plugin.engine
    return {
        "fp8": {k: v.clone() for k, v in fp8_state_dict(module).items()},
        "skips": [e["step"] for e in engine.events if e["kind"] == "skip"],
        "rollbacks": [e["step"] for e in engine.events if e["kind"] == "rollback"],
        "loss_scale": engine.loss_scale,
    }


def mp_strategy():
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


# -- scenarios -----------------------------------------------------------------------------------------------------
def lightning_fsdp2():
    """ModelParallelStrategy + FP8Precision (FP8 all-gather): 8 steps with a skip and a rollback, a distributed
    checkpoint at step 5 by a real ModelCheckpoint; a fresh Trainer resumes from it and trains steps 6-8."""
    ckpt_dir = os.path.join(OUT, "lightning_ckpt")
    plugin = FP8Precision(loss_scaling="dynamic")
    module = GPTModule(fsdp=True)
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=CKPT_STEP, save_top_k=-1)
    trainer(mp_strategy(), plugin, STEPS, [callback]).fit(module, loader())
    result = {"losses": module.losses, "weights": full_weights(module), **fp8_state(plugin, module)}
    result["local_is_fp8_ag"] = type(module.model.blocks[0].fc1.weight.to_local()).__name__
    path = os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir) if f"step={CKPT_STEP}" in f)[0])
    result["ckpt_is_dir"] = os.path.isdir(path)
    plugin_b = FP8Precision(loss_scaling="dynamic")
    resumed = GPTModule(fsdp=True)
    trainer(mp_strategy(), plugin_b, STEPS).fit(resumed, loader(), ckpt_path=path)
    result.update({"resumed_losses": resumed.losses, "resumed_weights": full_weights(resumed),
                   "resumed": fp8_state(plugin_b, resumed)})
    return result


def lightning_fsdp2_meta_init():
    """The large-model form of lightning_fsdp2: the LightningModule built under `trainer.init_module(empty_init=True)`
    (its GPT on the meta device, its linears FP8 layers), sharded in configure_model and materialized by Lightning
    (to_empty + reset_parameters); a distributed checkpoint at step 5; a fresh meta-built module resumes from it."""
    ckpt_dir = os.path.join(OUT, "meta_init_ckpt")
    started = {}

    class FreshState(L.Callback):
        def on_train_start(self, trainer, pl_module):  # after materialization, before any step (and any load)
            started.setdefault("fp8", {k: v.clone() for k, v in fp8_state_dict(pl_module).items()})

    def run(plugin, callbacks, **fit):
        fit_trainer = trainer(mp_strategy(), plugin, STEPS, callbacks)
        with fit_trainer.init_module(empty_init=True):
            module = GPTModule(fsdp=True)
        meta = all(p.is_meta for p in module.parameters())
        fit_trainer.fit(module, loader(), **fit)
        return module, meta

    plugin = FP8Precision(loss_scaling="dynamic")
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=CKPT_STEP, save_top_k=-1)
    module, built_on_meta = run(plugin, [callback, FreshState()])
    result = {"losses": module.losses, "weights": full_weights(module), **fp8_state(plugin, module),
              "built_on_meta": built_on_meta, "fp8_at_start": started["fp8"]}
    path = os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir) if f"step={CKPT_STEP}" in f)[0])
    plugin_b = FP8Precision(loss_scaling="dynamic")
    resumed, _ = run(plugin_b, [], ckpt_path=path)
    result.update({"resumed_losses": resumed.losses, "resumed_weights": full_weights(resumed),
                   "resumed": fp8_state(plugin_b, resumed)})
    return result


def lightning_ddp():
    """The same run under DDP: the reference the FSDP2 run must match to summation order."""
    plugin = FP8Precision(loss_scaling="dynamic")
    module = GPTModule(fsdp=False)
    trainer(DDPStrategy(), plugin, STEPS).fit(module, loader())
    return {"losses": module.losses, "weights": full_weights(module), **fp8_state(plugin, module)}


def lightning_fsdp2_fp8_optimizer():
    """ModelParallelStrategy with optimizer_state="fp8" (FP8AdamW on sharded parameters, sharded state in the
    distributed checkpoint): the resumed steps 6-8 must be bit-identical to the uninterrupted ones."""
    ckpt_dir = os.path.join(OUT, "lightning_fp8_optim_ckpt")
    kwargs = dict(loss_scaling="dynamic", optimizer_state="fp8", optimizer_kwargs={"min_numel_fp8": 256, "block_size": 32})
    plugin = FP8Precision(**kwargs)
    module = GPTModule(fsdp=True)
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=CKPT_STEP, save_top_k=-1)
    trainer(mp_strategy(), plugin, STEPS, [callback]).fit(module, loader())
    optimizer = module.trainer.optimizers[0]
    state = optimizer.state[module.model.blocks[1].fc1.weight]
    result = {"losses": module.losses, "weights": full_weights(module), "optimizer": type(optimizer).__name__,
              "state_types": {k: type(v).__name__ for k, v in state.items()},
              "exp_avg_dtype": str(state["exp_avg"].dtype), **fp8_state(plugin, module)}
    path = os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir) if f"step={CKPT_STEP}" in f)[0])
    plugin_b = FP8Precision(**kwargs)
    resumed = GPTModule(fsdp=True)
    trainer(mp_strategy(), plugin_b, STEPS).fit(resumed, loader(), ckpt_path=path)
    result.update({"resumed_losses": resumed.losses, "resumed_weights": full_weights(resumed),
                   "resumed": fp8_state(plugin_b, resumed)})
    return result


def _gpt_logits_loss(model, x, y):
    logits = model(x)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _fabric_run(fsdp2: bool, communication: str = "bf16"):
    """Fabric with ModelParallelStrategy (FSDP2) or DDP: the same faults, fabric.save at step 5, then a fresh setup
    resumes with lightning_fp8.fabric.load_checkpoint and trains steps 6-8."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
    from lightning_fp8.fabric import load_checkpoint

    missing_call_error = {}

    def build():
        plugin = FabricFP8Precision(loss_scaling="dynamic", gradient_communication=communication)

        def parallelize(model, mesh):
            plugin.convert_for_fsdp(model)  # before fully_shard (Fabric has converted already: FP8 all-gather here)
            for block in model.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(model, mesh=mesh["data_parallel"])
            return model

        strategy = FabricModelParallel(parallelize, data_parallel_size=2, tensor_parallel_size=1) if fsdp2 else FabricDDP()
        fabric = Fabric(accelerator="cpu", devices=2, plugins=[plugin], strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        gpt = GPT(CFG)
        step = {"i": 0}
        faults(gpt, lambda: step["i"])
        model = fabric.setup_module(gpt)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        if communication == "fp8" and not fsdp2:
            try:  # Fabric never shows the plugin its DDP wrapper: without the helper the first backward refuses
                fabric.backward(_gpt_logits_loss(model, *batch(0, rank())))
                missing_call_error["message"] = "no error"
            except RuntimeError as error:
                missing_call_error["message"] = str(error)
            optimizer.zero_grad()
            plugin.setup_gradient_communication(model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return fabric, plugin, model, optimizer, scheduler, step

    def train(fabric, model, optimizer, scheduler, step, steps):
        losses = []
        for i in steps:
            step["i"] = i
            x, y = batch(i, rank())
            loss = _gpt_logits_loss(model, x, y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    fabric, plugin, model, optimizer, scheduler, step = build()
    losses = train(fabric, model, optimizer, scheduler, step, range(CKPT_STEP))
    path = os.path.join(OUT, f"fabric_{'fsdp2' if fsdp2 else 'ddp'}_ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "fp8": plugin})
    losses += train(fabric, model, optimizer, scheduler, step, range(CKPT_STEP, STEPS))
    result = {"losses": losses, "weights": full_weights(model), **fp8_state(plugin, model.module),
              "missing_call_error": missing_call_error.get("message"),
              "fp8_comm": bool(getattr(model._forward_module, "_lightning_fp8_gradient_communication", False))}
    fabric_b, plugin_b, model_b, optimizer_b, scheduler_b, step_b = build()
    state = {"model": model_b, "optimizer": optimizer_b, "scheduler": scheduler_b, "fp8": plugin_b}
    load_checkpoint(fabric_b, path, state)
    result["plugin_restored"] = state["fp8"] is plugin_b and plugin_b.engine.step_count == CKPT_STEP
    resumed = train(fabric_b, model_b, optimizer_b, scheduler_b, step_b, range(CKPT_STEP, STEPS))
    result.update({"resumed_losses": resumed, "resumed_weights": full_weights(model_b),
                   "resumed": fp8_state(plugin_b, model_b.module)})
    return result


def fabric_fsdp2():
    return _fabric_run(fsdp2=True)


def fabric_ddp():
    return _fabric_run(fsdp2=False)


def fabric_fp8_comm():
    """Fabric with gradient_communication="fp8": DDP (the helper call, and the error without it) and FSDP2 (the FP8
    reduce-scatter installed at the first backward)."""
    return {"ddp": _fabric_run(fsdp2=False, communication="fp8"), "fsdp2": _fabric_run(fsdp2=True, communication="fp8")}


def _accelerate_run(fsdp2: bool):
    """FP8Accelerator under FSDP2 (Accelerate's own fully_shard path) or DDP: the faults, save_state at step 5, then
    a fresh accelerator load_state()s and trains steps 6-8."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs

    def build():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True) if fsdp2 else None
        accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", fsdp_plugin=fsdp_plugin,
                                     kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic")])
        if fsdp2:  # Accelerate ignores an FSDP plugin on CPU (MULTI_CPU): force its FSDP2 path, as on GPUs (both
            # singletons: AcceleratorState copies PartialState's fields whenever it is constructed again)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            accelerator.state.distributed_type = DistributedType.FSDP
            accelerator.state.fsdp_plugin = fsdp_plugin
        torch.manual_seed(0)
        gpt = GPT(CFG)
        step = {"i": 0}
        faults(gpt, lambda: step["i"])
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        model, optimizer, scheduler = accelerator.prepare(gpt, optimizer, scheduler)
        return accelerator, model, optimizer, scheduler, step

    def train(accelerator, model, optimizer, scheduler, step, steps):
        losses = []
        for i in steps:
            step["i"] = i
            x, y = batch(i, rank())
            loss = _gpt_logits_loss(model, x, y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    def fp8_summary(accelerator, model):
        engine, inner = accelerator.fp8_engine, accelerator.unwrap_model(model)
        return {"fp8": {k: v.clone() for k, v in fp8_state_dict(inner).items()},
                "skips": [e["step"] for e in engine.events if e["kind"] == "skip"],
                "rollbacks": [e["step"] for e in engine.events if e["kind"] == "rollback"],
                "loss_scale": engine.loss_scale}

    partial_type = PartialState().distributed_type
    accelerator, model, optimizer, scheduler, step = build()
    inner = accelerator.unwrap_model(model)
    result = {"is_fsdp2": accelerator.is_fsdp2,
              "fp8_all_gather": type(inner.blocks[0].fc1.weight.to_local()).__name__ if fsdp2 else None}
    losses = train(accelerator, model, optimizer, scheduler, step, range(CKPT_STEP))
    path = os.path.join(OUT, f"accelerate_{'fsdp2' if fsdp2 else 'ddp'}_ckpt")
    accelerator.save_state(path)
    losses += train(accelerator, model, optimizer, scheduler, step, range(CKPT_STEP, STEPS))
    result.update({"losses": losses, "weights": full_weights(inner), **fp8_summary(accelerator, model)})
    accelerator_b, model_b, optimizer_b, scheduler_b, step_b = build()
    accelerator_b.load_state(path)
    resumed = train(accelerator_b, model_b, optimizer_b, scheduler_b, step_b, range(CKPT_STEP, STEPS))
    result.update({"resumed_losses": resumed, "resumed_weights": full_weights(accelerator_b.unwrap_model(model_b)),
                   "resumed": fp8_summary(accelerator_b, model_b)})
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._shared_state["distributed_type"] = partial_type
    return result


def accelerate_fsdp2():
    return _accelerate_run(fsdp2=True)


def accelerate_ddp():
    return _accelerate_run(fsdp2=False)


def lightning_ddp_fp8_comm():
    """DDP with gradient_communication="fp8" (the comm hook, registered by the plugin's connect): rank 1's inf
    gradients must reach rank 0 through the FP8 reduction, so both skip."""
    plugin = FP8Precision(loss_scaling="dynamic", gradient_communication="fp8")
    module = GPTModule(fsdp=False)
    seen = {}

    class Registered(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["hook"] = bool(getattr(trainer.strategy.model, "_lightning_fp8_gradient_communication", False))

    trainer(DDPStrategy(), plugin, STEPS, [Registered()]).fit(module, loader())
    return {"losses": module.losses, "weights": full_weights(module), "registered": seen.get("hook"),
            **fp8_state(plugin, module)}


def lightning_fsdp2_fp8_comm():
    """ModelParallelStrategy with FP8 all-gather and gradient_communication="fp8" (FSDP2's reduce-scatter)."""
    plugin = FP8Precision(loss_scaling="dynamic", gradient_communication="fp8")
    module = GPTModule(fsdp=True)
    trainer(mp_strategy(), plugin, STEPS).fit(module, loader())
    comm = module.model.blocks[0]._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
    return {"losses": module.losses, "weights": full_weights(module), "comm": type(comm).__name__,
            **fp8_state(plugin, module)}



def ddp_hooks():
    """fp8_comm_hook on a plain DDP model (no FP8 layers needed): gradients vs the float32 all-reduce, bytes vs a BF16
    all-reduce, and an inf on one rank reaching the other."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from lightning_fp8.distributed import CommBytes, FP8CommState, bf16_comm_hook, fp8_comm_hook

    torch.manual_seed(0)
    base = GPT(CFG)
    x, y = batch(0, rank())
    variants = {"fp32": (None, None), "bf16": (None, bf16_comm_hook), "fp8": (FP8CommState(), fp8_comm_hook),
                "fp8_all_to_all": (FP8CommState(algorithm="all_to_all"), fp8_comm_hook),
                "fp8_e5m2_per_bucket": (FP8CommState(fmt="e5m2", scaling="per_bucket"), fp8_comm_hook)}
    result = {}
    for name, (state, hook) in variants.items():
        ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.05)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        with CommBytes() as counter:
            _gpt_logits_loss(ddp, x, y).backward()  # through DDP's forward: its reducer syncs the gradients
        result[name] = {"grads": [p.grad.clone() for p in ddp.module.parameters()], "table": counter.table(),
                        "bus_bytes": counter.total("bus_bytes")}
    ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.05)
    ddp.register_comm_hook(FP8CommState(), fp8_comm_hook)
    if rank() == 1:
        ddp.module.blocks[0].fc1.weight.register_hook(lambda g: g * float("inf"))
    _gpt_logits_loss(ddp, x, y).backward()
    result["finite_fc1"] = bool(torch.isfinite(ddp.module.blocks[0].fc1.weight.grad).all())
    result["finite_all"] = all(bool(torch.isfinite(p.grad).all()) for p in ddp.module.parameters())
    return result


def fsdp2_reduce_scatter():
    """FP8ReduceScatter on FSDP2 units: gradients vs the float32 reduce-scatter, bytes vs a BF16 one, inf propagation."""
    import copy

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_fp8.distributed import CommBytes, enable_fp8_reduce_scatter

    torch.manual_seed(0)
    base = GPT(CFG)
    x, y = batch(0, rank())

    def shard(model, reduce_dtype):
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    result = {}
    for name, reduce_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8", torch.float32)):
        model = shard(copy.deepcopy(base), reduce_dtype)
        if name == "fp8":
            result["units"] = enable_fp8_reduce_scatter(model)
        with CommBytes() as counter:
            model.loss(x, y).backward()
        result[name] = {"grads": [p.grad.full_tensor() for p in model.parameters()], "table": counter.table(),
                        "reduce_bytes": counter.total("bus_bytes", ops=("_reduce_scatter_base_", "alltoall_base_", "allreduce_"))}
    model = shard(copy.deepcopy(base), torch.float32)
    enable_fp8_reduce_scatter(model)
    if rank() == 1:  # rank 1's gradients of block 1 (and of everything before it) become inf
        model.blocks[1].register_forward_hook(lambda mod, args, out: out.register_hook(lambda g: g * float("inf")) and None)
    model.loss(x, y).backward()
    result["block1_finite_local"] = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.blocks[1].parameters())
    result["block0_finite_local"] = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.blocks[0].parameters())
    return result


def all_gather_bytes():
    """Bytes all-gathered per forward + backward by FSDP2 for a GPT (default conversion: first and last linears in
    BF16): BF16 all-gather (MixedPrecisionPolicy(param_dtype=bf16)) vs FP8 all-gather, counted."""
    import copy

    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_fp8 import convert_to_fp8
    from lightning_fp8.distributed import CommBytes, enable_fp8_all_gather
    from lightning_fp8.modules.autocast import fp8_autocast

    cfg = GPTConfig(vocab_size=64, context=16, d_model=128, n_layers=8, n_heads=4)
    torch.manual_seed(0)
    base = convert_to_fp8(GPT(cfg), verbose=False)
    x, y = (t[:, : cfg.context] for t in batch(0, rank()))
    result = {}
    for name in ("bf16", "fp8"):
        model = copy.deepcopy(base)
        if name == "fp8":
            result["decisions"] = enable_fp8_all_gather(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        with CommBytes() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
                loss = model.loss(x, y)
            loss.backward()
        result[name] = {"table": counter.table(),
                        "gather_bytes": counter.total("bus_bytes", ops=("_allgather_base_", "allreduce_"))}
    return result


def all_gather_paths():
    """FP8 all-gather against the same model unsharded, same input on both ranks (so the averaged gradients equal the
    unsharded ones): every path that reads the weight, bit for bit. The last layer has 9 rows: uneven shards (5 / 4)."""
    import copy

    from lightning_fp8 import FP8Recipe
    from lightning_fp8.distributed import enable_fp8_all_gather, fp8_all_gather_reason
    from lightning_fp8.modules.autocast import fp8_autocast
    from lightning_fp8.modules.linear import FP8Linear

    torch.manual_seed(0)
    base = nn.Sequential(FP8Linear(32, 64), nn.ReLU(), FP8Linear(64, 64, bias=False), nn.ReLU(), FP8Linear(64, 9))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    reference, sharded = copy.deepcopy(base), copy.deepcopy(base)
    result = {"decisions": enable_fp8_all_gather(sharded)}
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)

    def run(model, train=True, grad=True, **autocast):
        model.train(train)
        for p in model.parameters():
            p.grad = None
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(**autocast):
            out = model(x)
        if grad:
            out.float().square().sum().backward()
        grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in model.parameters()] if grad else []
        return out.detach().float(), grads

    def same(name, **kwargs):
        a, b = run(reference, **kwargs), run(sharded, **kwargs)
        result[name] = torch.equal(a[0], b[0]) and all(torch.equal(g, h) for g, h in zip(a[1], b[1]))

    same("train_fp8")
    result["history"] = all(torch.equal(r.fp8_meta.amax_history, s.fp8_meta.amax_history)
                            for r, s in zip(reference, sharded) if isinstance(r, FP8Linear))
    same("eval_fp8", train=False, grad=False)
    same("fp8_autocast_disabled", enabled=False)
    same("recipe_override", recipe=FP8Recipe(format="e5m2"))
    reference[2].fp8_enabled = sharded[2].fp8_enabled = False  # what FP8LayerFallback does to a layer
    same("fallback_layer")
    reference[2].fp8_enabled = sharded[2].fp8_enabled = True
    with torch.no_grad():
        same("calibration", grad=False, calibrating=True)
    result["calibration_amax"] = all(torch.equal(r.fp8_meta.amax_history, s.fp8_meta.amax_history)
                                     for r, s in zip(reference, sharded) if isinstance(r, FP8Linear))

    def reads_weight(module, args):
        module.weight.sum()  # code other than the FP8 layer reading the gathered weight

    handle = sharded[0].register_forward_pre_hook(reads_weight)
    try:
        run(sharded)
        result["foreign_read"] = "no error"
    except RuntimeError as error:
        result["foreign_read"] = str(error)
    handle.remove()

    tied = nn.Sequential(nn.Embedding(64, 32), FP8Linear(32, 64))
    tied[1].weight = nn.Parameter(torch.randn(64, 32))
    tied[0].weight = tied[1].weight
    result["tied_reason"] = enable_fp8_all_gather(tied)["1"]
    result["tied_reason_attr"] = fp8_all_gather_reason(tied[1])

    unconverted = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    fully_shard(unconverted)
    try:
        FP8Precision().convert_module(unconverted)
        result["late_conversion"] = "no error"
    except RuntimeError as error:
        result["late_conversion"] = str(error)
    return result


def all_gather_lazy_scales():
    """FP8 all-gather of layers trained WITHOUT an engine (each closes its scaling step lazily, at its next training
    forward) against the same model unsharded, over several optimizer steps: outputs, gradients and histories bit for
    bit. The weight cast happens in FSDP2's pre-all-gather hook, before the forward: it must close the pending step
    first, or it casts with the history of the step before (exact scales, not powers of two, so a changed amax shows)."""
    import copy

    from lightning_fp8 import FP8Recipe
    from lightning_fp8.distributed import enable_fp8_all_gather
    from lightning_fp8.modules.linear import FP8Linear

    torch.manual_seed(0)
    recipe = FP8Recipe(power_of_2_scales=False)
    base = nn.Sequential(FP8Linear(32, 64, recipe=recipe), nn.ReLU(), FP8Linear(64, 32, recipe=recipe))
    reference, sharded = copy.deepcopy(base), copy.deepcopy(base)
    enable_fp8_all_gather(sharded)
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, sharded)]
    result = {"same": []}
    for step in range(4):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        outs = []
        for model, opt in zip((reference, sharded), optimizers):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().sum().backward()
            grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for p in model.parameters()]
            opt.step()
            outs.append((out.detach().float(), grads))
        (out_r, grads_r), (out_s, grads_s) = outs
        same = torch.equal(out_r, out_s) and all(torch.equal(a, b) for a, b in zip(grads_r, grads_s))
        same = same and all(torch.equal(r.fp8_meta.amax_history, s.fp8_meta.amax_history)
                            for r, s in zip(reference, sharded) if isinstance(r, FP8Linear))
        result["same"].append(same)
    return result


def _moe_run(fsdp: bool) -> dict:
    """A tiny Mixtral (tests/support/moe_models.py) for 4 steps under the Lightning plugin, each rank on its own
    batches: FSDP2 (fully_shard per decoder layer: the experts' 3-D weights sharded over the experts) or DDP."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
    from support.moe_models import moe_model, token_batches

    class MoEModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = moe_model("mixtral")
            self.losses = []

        def configure_model(self) -> None:
            if fsdp:
                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, _):
            loss = self.model(**batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    plugin = FP8Precision()
    module = MoEModule()
    trainer(mp_strategy() if fsdp else DDPStrategy(), plugin, 4).fit(
        module, DataLoader(token_batches(4, seed=rank()), batch_size=None))
    return {"losses": module.losses, "weights": full_weights(module), **fp8_state(plugin, module),
            "experts": sorted(fqn for fqn, m in module.named_modules() if type(m).__name__ == "FP8GroupedLinear")}


def moe_fsdp2():
    """Mixture-of-experts layers under FSDP2: the experts' grouped FP8 GEMMs on the gathered expert weights, their
    FP8 state closed with every other layer's in the engine's one collective."""
    return _moe_run(fsdp=True)


def moe_ddp():
    """The same run under DDP: the reference of moe_fsdp2."""
    return _moe_run(fsdp=False)


def all_gather_amax_collectives():
    """The weight-amax agreement of FP8 all-gather, counted: MAX all-reduces per training iteration for models of 2 and
    4 FP8 layers (each its own FSDP2 unit; the last one unevenly sharded), with the agreement made after each optimizer
    step (`precompute_fp8_weight_amaxes`, as the engine's iteration close does) and without (the forward's first
    gather agrees them all); outputs, gradients, histories and weights bit for bit against the same model unsharded.
    Then a write to the weights between the agreement and the forward (an EMA swap would do it): not used stale."""
    import copy

    from lightning_fp8 import FP8Recipe
    from lightning_fp8.distributed import all_gather, enable_fp8_all_gather
    from lightning_fp8.modules.linear import FP8Linear

    precompute = getattr(all_gather, "precompute_fp8_weight_amaxes", None)  # absent before the batched agreement
    counted = []
    if hasattr(all_gather, "_all_reduce_max"):
        real = all_gather._all_reduce_max
        all_gather._all_reduce_max = lambda tensor, group: (counted.append(tensor.numel()), real(tensor, group))
    else:  # the per-layer all-reduce of before: count every all-reduce
        real = dist.all_reduce
        dist.all_reduce = lambda tensor, *a, **k: (counted.append(tensor.numel()), real(tensor, *a, **k))[1]
    recipe = FP8Recipe(power_of_2_scales=False)  # exact scales: a changed amax shows in every output
    result = {}
    try:
        for layers in (2, 4):
            for mode in ("precompute", "lazy", "write"):
                torch.manual_seed(layers)
                widths = [32] * layers + [9]
                linears = [FP8Linear(widths[i], widths[i + 1], recipe=recipe) for i in range(layers)]
                base = nn.Sequential(*[m for linear in linears for m in (linear, nn.ReLU())][:-1])
                reference, sharded = copy.deepcopy(base), copy.deepcopy(base)
                enable_fp8_all_gather(sharded)
                for layer in sharded:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer)
                fully_shard(sharded)
                optimizers = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (reference, sharded)]
                per_iteration, same = [], []
                for step in range(4):
                    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
                    before = len(counted)
                    if mode == "write" and step == 2:  # after the agreement: every weight scaled on every rank
                        with torch.no_grad():
                            for model in (reference, sharded):
                                for layer in model:
                                    if isinstance(layer, nn.Linear):
                                        layer.weight.mul_(1.5)
                    outs = []
                    for model, opt in zip((reference, sharded), optimizers):
                        opt.zero_grad()
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            out = model(x)
                        out.float().square().sum().backward()
                        grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                                 for p in model.parameters()]
                        opt.step()
                        if model is sharded and mode != "lazy" and precompute is not None:
                            precompute(sharded)  # what the engine does when the iteration closes
                        weights = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                   for p in model.parameters()]
                        outs.append((out.detach().float(), grads, weights))
                    per_iteration.append(len(counted) - before)
                    (out_r, grads_r, w_r), (out_s, grads_s, w_s) = outs
                    ok = torch.equal(out_r, out_s) and all(torch.equal(a, b) for a, b in zip(grads_r, grads_s))
                    ok = ok and all(torch.equal(a, b) for a, b in zip(w_r, w_s))
                    ok = ok and all(torch.equal(r.fp8_meta.amax_history, s.fp8_meta.amax_history)
                                    for r, s in zip(reference, sharded) if isinstance(r, FP8Linear))
                    same.append(ok)
                result[(layers, mode)] = {"per_iteration": per_iteration, "same": same}
        result["sizes"] = sorted(set(counted))
    finally:
        if hasattr(all_gather, "_all_reduce_max"):
            all_gather._all_reduce_max = real
        else:
            dist.all_reduce = real
    return result


SCENARIOS = {
    "lightning_fsdp2": lightning_fsdp2,
    "lightning_fsdp2_meta_init": lightning_fsdp2_meta_init,
    "lightning_ddp": lightning_ddp,
    "lightning_fsdp2_fp8_optimizer": lightning_fsdp2_fp8_optimizer,
    "fabric_fsdp2": fabric_fsdp2,
    "fabric_ddp": fabric_ddp,
    "fabric_fp8_comm": fabric_fp8_comm,
    "accelerate_fsdp2": accelerate_fsdp2,
    "accelerate_ddp": accelerate_ddp,
    "lightning_ddp_fp8_comm": lightning_ddp_fp8_comm,
    "lightning_fsdp2_fp8_comm": lightning_fsdp2_fp8_comm,
    "ddp_hooks": ddp_hooks,
    "fsdp2_reduce_scatter": fsdp2_reduce_scatter,
    "all_gather_bytes": all_gather_bytes,
    "all_gather_paths": all_gather_paths,
    "all_gather_lazy_scales": all_gather_lazy_scales,
    "all_gather_amax_collectives": all_gather_amax_collectives,
    "moe_fsdp2": moe_fsdp2,
    "moe_ddp": moe_ddp,
}


def main() -> None:
    names = sys.argv[2:] or list(SCENARIOS)
    dist.init_process_group("gloo")
    try:
        for name in names:
            prefix = os.path.join(OUT, f"{name}.rank{rank()}")
            try:
                torch.save(SCENARIOS[name](), prefix + ".pt")
            except Exception:  # noqa: BLE001 - reported to the test through the error file
                with open(prefix + ".error", "w") as f:
                    f.write(traceback.format_exc())
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
