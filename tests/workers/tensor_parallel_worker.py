"""Run by tests/test_tensor_parallel.py (2 CPU ranks, gloo, one tensor-parallel group of 2): every multi-process
check of tensor and sequence parallelism in FP8 in ONE launch (imports dominate a launch).

    python tests/workers/tensor_parallel_worker.py OUT_DIR [scenario ...]  # forks its 2 ranks (launch_forked)
    python -m torch.distributed.run --nproc_per_node 2 tests/workers/tensor_parallel_worker.py OUT_DIR [scenario ...]

Each scenario writes OUT_DIR/<scenario>.rank<r>.pt; one that raises writes OUT_DIR/<scenario>.rank<r>.error and the
others still run. The model is the char-GPT laid out for tensor parallelism (lightning_fp8/demo/parallel_gpt.py),
tiny. Every rank of the group reads the same batch (tensor parallelism splits the model, not the data).
"""
import copy
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
from support.parallel_training import (  # noqa: E402
    CFG, STEPS, full_weights, inf_gradient_on_rank_1, nan_loss_on_rank_0, rank, run_scenarios, schedule,
)
from support.torchrun_launch import launch_forked  # noqa: E402

from lightning_fp8 import FP8Precision, FP8Recipe, convert_to_fp8, fp8_state_dict  # noqa: E402
from lightning_fp8.conversion.summary import conversion_summary  # noqa: E402
from lightning_fp8.demo.parallel_gpt import ParallelGPT, parallelize_gpt  # noqa: E402
from lightning_fp8.distributed import CommBytes  # noqa: E402
from lightning_fp8.engine.engine import FP8TrainingEngine  # noqa: E402
from lightning_fp8.modules.autocast import fp8_autocast  # noqa: E402

OUT = sys.argv[1]




def batch(step: int, dp_rank: int = 0, batch_size: int = 4):
    """The batch of (global step, data-parallel rank): every rank of a tensor-parallel group reads the same one."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, CFG.vocab_size, (batch_size, CFG.context + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]










def events(engine) -> dict:
    return {"skips": [e["step"] for e in engine.events if e["kind"] == "skip"],
            "rollbacks": [e["step"] for e in engine.events if e["kind"] == "rollback"],
            "loss_scale": engine.loss_scale}


def tp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tensor_parallel",))


# -- Lightning ------------------------------------------------------------------------------------------------------
class GPTModule(L.LightningModule):
    """configure_model applies the TP plan, lightning_fp8's styles or torch's, to the model the plugin converted
    before configure_model (no lightning_fp8 line in it)."""

    def __init__(self, fp8_styles: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ParallelGPT(CFG)
        self.fp8_styles = fp8_styles
        self.losses = []

    def configure_model(self) -> None:
        parallelize_gpt(self.model, self.device_mesh["tensor_parallel"], fp8_styles=self.fp8_styles)

    def training_step(self, _, __):
        x, y = batch(self.trainer.global_step)
        loss = self.model.loss(x, y)
        self.losses.append(float(loss.detach()))
        return nan_loss_on_rank_0(loss, self.trainer.global_step)

    def on_after_backward(self) -> None:
        inf_gradient_on_rank_1(self.model, self.trainer.global_step)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}]


def _lightning_tp(fp8_styles: bool):
    plugin = FP8Precision(loss_scaling="dynamic")
    module = GPTModule(fp8_styles)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        plugins=[plugin], max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, gradient_clip_val=1.0, num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(list(range(4 * STEPS)), batch_size=1))
    fc1 = module.model.blocks[1].mlp.fc1
    return {"losses": module.losses, "weights": full_weights(module.model), **events(plugin.engine),
            "fp8": {k: v.clone() for k, v in fp8_state_dict(module.model).items()},
            "summary": conversion_summary(module.model).text(), "fc1": type(fc1).__name__,
            "fc1_weight": f"{type(fc1.weight).__name__}{tuple(fc1.weight.placements)}",
            "meta_buffer": type(fc1.fp8_meta.amax_history).__name__}


def lightning_tp():
    """ModelParallelStrategy(tensor_parallel_size=2) + FP8Precision, lightning_fp8's styles with sequence parallelism:
    6 steps with a skip and a rollback injected on one rank each."""
    return _lightning_tp(fp8_styles=True)


def lightning_tp_torch_styles():
    """The same run with torch's ColwiseParallel / RowwiseParallel / PrepareModuleInput (on the FP8 layers)."""
    return _lightning_tp(fp8_styles=False)


# -- the plain loop: TP=2 against one rank ----------------------------------------------------------------------
def _engine_run(model: nn.Module, steps: int, compute_dtype: torch.dtype):
    """`steps` clean iterations driven by FP8TrainingEngine (AdamW, warmup + cosine to zero, clipping 1.0), under
    autocast to `compute_dtype` (float32: no autocast)."""
    engine = FP8TrainingEngine(FP8Recipe(), compute_dtype=compute_dtype)
    engine.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    engine.track([opt], [sched])
    losses = []
    for step in range(steps):
        engine.begin_iteration()
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype != torch.float32), fp8_autocast():
            loss = model.loss(x, y)
        engine.scale_loss(loss).backward()
        engine.clip_grad_norm_(opt, 1.0)
        engine.step(opt, opt.step)
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, engine


def tp_vs_single():
    """The same 6 clean iterations on one rank (no parallelism, computed on every rank alike) and with TP=2
    (lightning_fp8's styles, sequence parallel), from the same initial weights and data; under BF16 autocast (row-wise
    layers' partial sums are BF16) and in float32 (they are float32)."""
    steps = 6
    result = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        torch.manual_seed(0)
        base = ParallelGPT(CFG)
        single = convert_to_fp8(copy.deepcopy(base), verbose=False)
        single_losses, _ = _engine_run(single, steps, dtype)
        tp = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), verbose=False), tp_mesh())
        tp_losses, engine = _engine_run(tp, steps, dtype)
        result[name] = {"single": single_losses, "tp": tp_losses,
                        "fp8": {k: v.clone() for k, v in fp8_state_dict(tp).items()}, **events(engine)}
    return result


# -- what each path computes: FP8 communication against torch's ------------------------------------------------------
def _pair(recipe=None):
    """The same converted model parallelized with lightning_fp8's styles and with torch's (torch's plan applied before
    conversion: an order plain PyTorch users may choose; the other order: torch_styles_on_fp8_layers)."""
    torch.manual_seed(0)
    base = ParallelGPT(CFG)
    fp8 = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), recipe, verbose=False), tp_mesh())
    plain = convert_to_fp8(parallelize_gpt(copy.deepcopy(base), tp_mesh(), fp8_styles=False), recipe, verbose=False)
    return fp8, plain


def _grads(model):
    return [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in model.parameters()]


def _run(model, step, train=True, grad=True, **autocast):
    model.train(train)
    for p in model.parameters():
        p.grad = None
    x, y = batch(step)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(**autocast):
        logits = model(x)
    if grad:
        nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return logits.detach().float(), _grads(model) if grad else []


def sp_paths():
    """lightning_fp8's styles against torch's on the same model, bit for bit, on every path that reads a gathered
    input: training steps (the first casts without history, the later ones with the delayed scale: each layer
    closes its own steps here), evaluation (current scaling), fp8_autocast(enabled=False), a recipe override, a layer
    moved to BF16 (the exact high-precision input through a second gather), calibration."""
    from lightning_fp8.modules.linear import FP8Layer

    fp8, plain = _pair()
    result = {}

    def same(name, step, **kwargs):
        a, b = _run(fp8, step, **kwargs), _run(plain, step, **kwargs)
        result[name] = torch.equal(a[0], b[0]) and all(torch.equal(g, h) for g, h in zip(a[1], b[1]))

    for step in range(3):
        same(f"train_{step}", step)
    histories = [(f.fp8_meta.amax_history, p.fp8_meta.amax_history) for f, p in zip(fp8.modules(), plain.modules())
                 if isinstance(f, FP8Layer)]
    # every FP8 layer of either model, paired (the first / last rule keeps the same layers in BF16 in both)
    result["histories"] = (all(torch.equal(a, b) for a, b in histories)
                           and len(histories) == sum(isinstance(m, FP8Layer) for m in plain.modules()) > 0)
    same("eval", 3, train=False, grad=False)
    same("fp8_autocast_disabled", 4, enabled=False)
    same("recipe_override", 5, recipe=FP8Recipe(format="e5m2"))
    for model in (fp8, plain):
        model.blocks[1].mlp.fc1.fp8_enabled = False  # what FP8LayerFallback does
    same("fallback_layer", 6)
    for model in (fp8, plain):
        model.blocks[1].mlp.fc1.fp8_enabled = True
    with torch.no_grad():
        same("calibration", 7, grad=False, calibrating=True)
    return result


def gather_scales():
    """The FP8 all-gather on its own: slices of very different magnitude (rank 1's 300x rank 0's) cast with their own
    current scales are brought to the whole tensor's, against one cast of the whole tensor with its amax: with
    power-of-two scales the same bytes except values in FP8's subnormal range (one subnormal step at most: re-rounding
    a shifted subnormal), otherwise within one FP8 step (rank 0's slice rounds twice)."""
    from lightning_fp8.distributed.sequence_parallel import InputCast, SequenceComm, gather_in_fp8
    from lightning_fp8.modules.cast import cast_to_fp8
    from lightning_fp8.modules.linear import FP8Linear
    from lightning_fp8.modules.gathered_fp8 import CastKey
    from lightning_fp8.numerics.formats import E4M3
    from lightning_fp8.numerics.scaling import scale_from_amax

    result = {}
    g = torch.Generator().manual_seed(11)
    whole = torch.randn(2, 8, 32, generator=g)
    whole[:, 4:] *= 300.0  # rank 1's half of the sequence
    local = whole.chunk(2, dim=1)[rank()].clone()
    comm = SequenceComm(tp_mesh().get_group(), 1)
    for p2 in (True, False):
        recipe = FP8Recipe(power_of_2_scales=p2)
        layer = FP8Linear(32, 16, recipe=recipe)
        gathered = gather_in_fp8(local, InputCast(layer, CastKey.of(recipe, True, "input")), comm)
        amax = whole.abs().amax()
        scale = scale_from_amax(amax, E4M3.max, 0, 1.0, p2)
        expected, got = cast_to_fp8(whole, scale, E4M3).float(), gathered._data.float()
        differ = got != expected
        result[f"p2_{p2}"] = {
            "scale": float(gathered._scale) == float(scale), "amax": float(gathered._amax) == float(amax),
            "differ": int(differ.sum()), "numel": differ.numel(),
            # where they differ: both subnormal (below E4M3's 2^-6) and one subnormal step (2^-9) apart ...
            "subnormal_only": bool((expected[differ].abs() <= 2**-6).all() and (got[differ].abs() <= 2**-6).all()),
            "max_abs_step": float((got - expected).abs().max()),
            # ... or at most one FP8 step (an eighth of the value's binade) apart
            "max_rel_step": float(((got - expected).abs() / expected.abs().clamp_min(2**-6))[differ].max())
            if differ.any() else 0.0,
        }
    return result


def block_bytes(model, x, autocast: bool) -> CommBytes:
    """The collectives of block 1's forward, counted at the dispatcher."""
    counted = {}

    def enter(module, args):
        counted["mode"] = CommBytes().__enter__()

    def leave(module, args, out):
        counted["mode"].__exit__(None, None, None)

    model.blocks[1].register_forward_pre_hook(enter)
    model.blocks[1].register_forward_hook(leave)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(x)
    return counted["mode"]


def sp_bytes():
    """Bytes of one transformer block's forward (attention and MLP, sequence parallel), counted at the dispatcher:
    lightning_fp8's styles against torch's with BF16 activations (the model in BF16, no autocast), and the
    collectives of a whole training step by kind and dtype, with gradient_communication "bf16" and "fp8"."""
    torch.manual_seed(0)
    base = ParallelGPT(CFG)
    recipe = FP8Recipe(keep_first_last_in_bf16=False)
    x, y = batch(0)
    result = {}

    fp8 = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), recipe, verbose=False), tp_mesh())
    bf16 = convert_to_fp8(parallelize_gpt(copy.deepcopy(base).bfloat16(), tp_mesh(), fp8_styles=False), recipe,
                          verbose=False)
    f, b = block_bytes(fp8, x, True), block_bytes(bf16, x, False)
    result["block_fp8"], result["block_bf16"] = f.table(), b.table()
    result["gather_fp8"] = f.total("bus_bytes", ops=("_allgather_base_", "all_gather_into_tensor"))
    result["gather_bf16"] = b.total("bus_bytes", ops=("_allgather_base_", "all_gather_into_tensor"))
    for communication in ("bf16", "fp8"):
        model = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), recipe, verbose=False), tp_mesh())
        from lightning_fp8.distributed.tensor_parallel import follow_plugin_communication

        follow_plugin_communication(model, communication)
        with CommBytes() as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(x, y)
            loss.backward()
        result[f"step_{communication}"] = counter.table()
        result[f"grads_{communication}"] = _grads(model)
    return result


def comm_follows_compute():
    """gradient_communication="fp8" on layers that do not cast their input per tensor in FP8: row-wise layers moved
    to BF16 (what FP8LayerFallback does) and a fine-grained (rowwise-scaled) model. Their styles communicate in high
    precision, and the conversion summary says so: block 1's forward collectives by kind and dtype, and the summary."""
    from lightning_fp8.distributed.tensor_parallel import follow_plugin_communication

    torch.manual_seed(0)
    base = ParallelGPT(CFG)
    x, _ = batch(0)
    result = {}
    for name, recipe in (("fallback", FP8Recipe(keep_first_last_in_bf16=False)),
                         ("finegrained", FP8Recipe(scaling="rowwise", keep_first_last_in_bf16=False))):
        model = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), recipe, verbose=False), tp_mesh())
        follow_plugin_communication(model, "fp8")
        if name == "fallback":
            for block in model.blocks:
                block.attn.proj.fp8_enabled = block.mlp.fc2.fp8_enabled = False
        result[name] = {"table": block_bytes(model, x, True).table(), "summary": conversion_summary(model).text()}
    return result


def tp_errors():
    """A plan that cannot be right is refused with a message that says what to use instead."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_fp8.distributed import FP8ColwiseParallel, PrepareFP8ModuleInput

    result = {}
    torch.manual_seed(0)
    model = convert_to_fp8(ParallelGPT(CFG), FP8Recipe(keep_first_last_in_bf16=False), verbose=False)
    plan = {"blocks.0.attn": PrepareFP8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "blocks.0.attn.q": ColwiseParallel(), "blocks.0.attn.k": FP8ColwiseParallel(),
            "blocks.0.attn.v": FP8ColwiseParallel()}
    parallelize_module(model, tp_mesh(), plan)
    x = model.blocks[0].ln1(torch.randn(2, CFG.context // 2, CFG.d_model))  # this rank's slice of the sequence
    try:  # torch's ColwiseParallel reading an FP8-gathered input would all-reduce its gradient a second time
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.blocks[0].attn(x)
        result["torch_reader"] = "no error"
    except RuntimeError as error:
        result["torch_reader"] = str(error)
    return result


def torch_styles_on_fp8_layers():
    """torch's plain styles applied to a converted model (what the plugins do now: they convert before the user's
    parallelize code) compute what lightning_fp8's styles compute, bit for bit, over three training steps; and
    Fabric's ModelParallelStrategy with torch's styles in the parallelize function trains (before: torch's
    RowwiseParallel failed on the FP8 metadata submodule)."""
    torch.manual_seed(0)
    base = ParallelGPT(CFG)
    fp8 = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), verbose=False), tp_mesh())
    plain = parallelize_gpt(convert_to_fp8(copy.deepcopy(base), verbose=False), tp_mesh(), fp8_styles=False)
    result = {}
    for step in range(3):
        a, b = _run(fp8, step), _run(plain, step)
        result[f"train_{step}"] = torch.equal(a[0], b[0]) and all(torch.equal(g, h) for g, h in zip(a[1], b[1]))
    result["summary"] = conversion_summary(plain).text()
    result["fabric_losses"] = _fabric_with_torch_styles()
    return result


def _fabric_with_torch_styles():
    """Fabric's ModelParallelStrategy with torch's styles in the parallelize function (Fabric's FP8 plugin converts
    before it): 3 steps, their losses."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    strategy = FabricModelParallel(lambda model, mesh: parallelize_gpt(model, mesh["tensor_parallel"], fp8_styles=False),
                                   data_parallel_size=1, tensor_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=2, plugins=[FabricFP8Precision()], strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(ParallelGPT(CFG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(3):
        x, y = batch(step)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def fabric_tp():
    """Fabric with ModelParallelStrategy(tensor_parallel_size=2) and gradient_communication="fp8": Fabric converts
    before the parallelize function, which applies lightning_fp8's styles; the plugin adopts them at the first
    forward (the styles' reduce-scatters follow its gradient_communication, the summary says how the layers are
    split); 4 steps."""
    import lightning.fabric.utilities.rank_zero as rank_zero
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    logged = []
    info = rank_zero.rank_zero_info
    rank_zero.rank_zero_info = lambda message, *args, **kwargs: (logged.append(message), info(message, *args, **kwargs))
    plugin = FabricFP8Precision(gradient_communication="fp8")
    strategy = FabricModelParallel(lambda model, mesh: parallelize_gpt(model, mesh["tensor_parallel"]),
                                   data_parallel_size=1, tensor_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=2, plugins=[plugin], strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(ParallelGPT(CFG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(4):
        x, y = batch(step)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        fabric.backward(loss)  # (no fabric.clip_gradients: Fabric clips with torch's clip_grad_norm_, which cannot mix
        optimizer.step()        # the DTensor gradients of TP layers with the plain ones of the rest of the model)
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    rank_zero.rank_zero_info = info
    inner = model.module
    styles = [style.reduce_precision for m in inner.modules() for style in m.__dict__.get("_fp8_tensor_parallel_styles", ())]
    return {"losses": losses, "fp8": {k: v.clone() for k, v in fp8_state_dict(inner).items()},
            "logged": "\n".join(logged), "steps": plugin.engine.step_count, "reduce_precisions": sorted(set(styles))}


def accelerate_tp():
    """FP8Accelerator with Accelerate's ParallelismConfig(tp_size=2): the model parallelized with lightning_fp8's
    styles on accelerator.torch_device_mesh["tp"] before prepare (what Accelerate requires); 4 steps."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    from lightning_fp8.accelerate import FP8Accelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    partial_type = PartialState(cpu=True).distributed_type
    # Accelerate validates a ParallelismConfig against multi-GPU types only (MULTI_CPU is refused): on these CPU
    # ranks, its multi-GPU path (as the FSDP2 tests force its FSDP path)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", parallelism_config=ParallelismConfig(tp_size=2))
    torch.manual_seed(0)
    model = ParallelGPT(CFG)
    convert_to_fp8(model, verbose=False)
    parallelize_gpt(model, accelerator.torch_device_mesh["tp"])
    model.tp_size = 2  # what Accelerate reads to check the model was parallelized (transformers sets it)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(4):
        x, y = batch(step)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    inner = accelerator.unwrap_model(model)
    result = {"losses": losses, "fp8": {k: v.clone() for k, v in fp8_state_dict(inner).items()},
              "steps": accelerator.fp8_engine.step_count}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._shared_state["distributed_type"] = partial_type
    return result


SCENARIOS = {
    "lightning_tp": lightning_tp,
    "lightning_tp_torch_styles": lightning_tp_torch_styles,
    "tp_vs_single": tp_vs_single,
    "sp_paths": sp_paths,
    "gather_scales": gather_scales,
    "sp_bytes": sp_bytes,
    "comm_follows_compute": comm_follows_compute,
    "tp_errors": tp_errors,
    "torch_styles_on_fp8_layers": torch_styles_on_fp8_layers,
    "fabric_tp": fabric_tp,
    "accelerate_tp": accelerate_tp,
}


def main() -> None:
    run_scenarios(SCENARIOS, OUT)


if __name__ == "__main__":
    launch_forked(main, 2)
