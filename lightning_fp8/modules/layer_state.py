"""FP8LayerState: the FP8 scaling state of one layer, as a few buffers the whole model's steps can close at once.

Buffers (what `fp8_state_dict` saves; they round-trip exactly):
  amax_history    float32 [3, L+1]: one row per tensor role (input, weight, grad_output), slot 0 the step in
                  progress, slots 1..L the completed steps (see lightning_fp8/numerics/scaling.py)
  overflow_count  int64 [3]: steps whose amax was inf / NaN (or, unscaled, beyond the format's range)
  clip_count      int64 [3]: delayed-scaling steps whose amax exceeded the range of the scale the casts used
  enabled         bool: the layer's precision switch (False: the layer computes in BF16)
  rng_state       int64 [2] (seed, offset), only for a recipe that rounds gradients stochastically with in-kernel
                  random numbers (NVFP4): the layer's own Philox stream (numerics.microscaling.philox_uniform), its
                  seed drawn once from torch's default generator when the buffer is created, its offset advanced on
                  the device by each cast's draws. Saved with the rest, so a resume continues the stream where it
                  stopped (bit-identical to an uninterrupted run); a checkpoint without it keeps the fresh one. The
                  casts find it through the history they are given (`stochastic_rounding_state`), so no call site
                  passes it.

Scales are not stored: every cast derives its scale from the history under its own recipe, and `scale(role)` /
`meta.input.scale` show the scale the next step's casts will use. The recipe's per-role constants (format range,
margin, ...) are kept as non-persistent buffers so the per-step update runs on the device without host data.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn

from lightning_fp8.numerics.scaling import StepConstants, reference_amax, scale_from_amax
from lightning_fp8.recipe import ROLES, FP8Recipe
from lightning_fp8.renamed import renamed_module_names

ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}


class FP8LayerState(nn.Module):
    """The FP8 metadata of one layer (see the module docstring)."""

    def __init__(self, recipe: FP8Recipe, device=None) -> None:
        super().__init__()
        n = len(ROLES)
        self.register_buffer("amax_history", torch.zeros(n, recipe.amax_history_len + 1, dtype=torch.float32, device=device))
        self.register_buffer("overflow_count", torch.zeros(n, dtype=torch.int64, device=device))
        self.register_buffer("clip_count", torch.zeros(n, dtype=torch.int64, device=device))
        self.register_buffer("enabled", torch.ones((), dtype=torch.bool, device=device))
        #: per role, whether the amax history is known to size a delayed scale: host-side knowledge, no buffer. The
        #: engine learns it with its once-per-iteration flags (engine/step_closer.py); a delayed cast then skips its amax
        #: pre-pass (kernels/ops.py `scaled_cast`). False, the safe default (a pre-pass), whenever the history may
        #: have been replaced: a reset, a load, a recipe change, a rollback
        self.history_sized: List[bool] = [False] * n
        #: the layer's name in a load that brought its weights but not this state while the state was fresh (its
        #: scaling restarts: `report_restarted_scaling` says so at its first training forward); None otherwise
        self.restarted_as: Optional[str] = None
        self.set_recipe(recipe)

    # -- recipe constants ----------------------------------------------------------------------------------------
    def set_recipe(self, recipe: FP8Recipe) -> None:
        """Adopt a recipe: per-role constants on the device, the history resized if the length changed."""
        self.recipe = recipe
        self.forget_sizes()
        device = self.amax_history.device
        for name, value in zip(StepConstants._fields, _step_constants(recipe, device)):
            self.register_buffer(f"recipe_{name}", value, persistent=False)
        if self.amax_history.shape[1] != recipe.amax_history_len + 1:
            self.amax_history = _resize_history(self.amax_history, recipe.amax_history_len + 1)
        if uses_rounding_stream(recipe) and "rng_state" not in self._buffers:
            self.register_buffer("rng_state", new_rounding_stream(device))
        self._attach_rounding_stream()

    def _attach_rounding_stream(self) -> None:
        """Let the casts find the stream from the history tensor they receive (module docstring): an attribute of the
        history buffer, set again whenever the buffer is replaced (a resize, `.to()`, a load with assign=True)."""
        stream = self._buffers.get("rng_state")
        if stream is not None:
            setattr(self.amax_history, _STREAM_ATTRIBUTE, stream)

    def _apply(self, fn, recurse=True):
        was_meta = self.amax_history.is_meta
        out = super()._apply(fn, recurse)
        if was_meta and not self.amax_history.is_meta:
            # materialized from the meta device (`to_empty`): the buffers hold uninitialized memory, never a state
            # anyone saved, so they become a fresh layer's state now, before anything can read them
            self.reset_parameters()
        self._attach_rounding_stream()
        return out

    @property
    def is_meta(self) -> bool:
        """True while the state lives on the meta device (a model built there, not materialized yet): no value to
        read; `to_empty` or a load that materializes the layer's weight gives it a fresh state."""
        return self.amax_history.is_meta

    @torch.no_grad()
    def materialize(self, device: torch.device) -> None:
        """Give a state still on the meta device a fresh one on `device` (the layer's weight's, after a load with
        `assign=True` placed it there); a state already on a real device is left as it is."""
        if self.is_meta:
            self.to_empty(device=device)

    def forget_sizes(self) -> None:
        """The histories may no longer size a delayed scale: the next delayed casts take their pre-pass."""
        self.history_sized = [False] * len(ROLES)

    def constants(self) -> StepConstants:
        """The per-role recipe constants closing a step reads (the `recipe_*` buffers, moved with the layer)."""
        return StepConstants(*(getattr(self, f"recipe_{name}") for name in StepConstants._fields))

    # -- views per role ------------------------------------------------------------------------------------------
    def role(self, role: str) -> "RoleState":
        return RoleState(self, role)

    @property
    def input(self) -> "RoleState":
        return RoleState(self, "input")

    @property
    def weight(self) -> "RoleState":
        return RoleState(self, "weight")

    @property
    def grad_output(self) -> "RoleState":
        return RoleState(self, "grad_output")

    def states(self) -> Dict[str, "RoleState"]:
        return {role: RoleState(self, role) for role in ROLES}

    @torch.no_grad()
    def reset(self) -> None:
        """Forget the amax history (the counters are the layer's record and stay): the next casts use current
        scaling, as a fresh layer's do."""
        self.amax_history.zero_()
        self.forget_sizes()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A fresh layer's state on the buffers' current device. `to_empty` from the meta device calls it itself
        (`_apply`); Lightning and Fabric also call `reset_parameters` on every module that holds buffers after they
        materialize an FSDP2 model, which then does it again, harmlessly."""
        if self.is_meta:
            return
        self.amax_history.zero_()
        self.overflow_count.zero_()
        self.clip_count.zero_()
        self.enabled.fill_(True)
        if "rng_state" in self._buffers:
            self.rng_state.copy_(new_rounding_stream(self.rng_state.device))
        self.set_recipe(self.recipe)

    # -- checkpoint compatibility --------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        _upgrade_per_role_layout(state_dict, prefix)
        # the load brings no FP8 state for this layer (a model state_dict never holds it: see FP8Layer) while the
        # layer's own is a fresh one: its scaling restarts, which a resumed run should hear about (`restarted_layers`)
        brings_state = prefix + "amax_history" in state_dict
        fresh = self.is_meta or not bool(self.amax_history.any())
        for name, buf in self._buffers.items():
            if name.startswith("recipe_"):
                continue
            key = prefix + name
            if key not in state_dict:
                # a checkpoint of a plain layer: keep the fresh values instead of failing a strict load
                state_dict[key] = buf.detach().clone()
            elif name == "amax_history" and state_dict[key].shape != buf.shape:
                state_dict[key] = _resize_history(state_dict[key], buf.shape[1])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.forget_sizes()
        self._attach_rounding_stream()
        if brings_state:
            self.restarted_as = None
            _RESTARTED.discard(self)
        elif fresh:
            self.restarted_as = prefix[: -len("fp8_meta.")].rstrip(".") or "(the model itself)"
            _RESTARTED.add(self)


#: FP8 states whose layer's weights were loaded without them while they were fresh (`FP8LayerState.restarted_as`)
_RESTARTED: "weakref.WeakSet[FP8LayerState]" = weakref.WeakSet()


def report_restarted_scaling() -> None:
    """Warn, once for everything loaded so far, which layers had their weights loaded without their FP8 scaling
    state (their first step uses current scaling, their amax histories start empty), and how to carry that state.
    Called by the first training forward of such a layer, so a state loaded after the weights (what the plugins'
    checkpoints do) clears the note before anything is said."""
    metas = list(_RESTARTED)
    _RESTARTED.clear()
    # only layers that compute in FP8 (a layer switched off, e.g. a first / last one, uses no scale); one host read
    # per layer, once per load
    names = sorted({meta.restarted_as for meta in metas
                    if meta.restarted_as is not None and not meta.is_meta and bool(meta.enabled)})
    for meta in metas:
        meta.restarted_as = None
    if not names:
        return
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    warnings.warn(
        f"lightning_fp8: {len(names)} FP8 layer(s) had their weights loaded without their FP8 scaling state ({shown}): "
        "their scaling restarts (amax histories empty, the first step uses current scaling). Expected when starting "
        "from pretrained weights. When resuming a run, save and load that state with the weights: Fabric "
        "`fabric.save(path, {..., 'fp8': fabric.strategy.precision})` and `fabric.load(path, {..., 'fp8': "
        "fabric.strategy.precision})`; plain PyTorch `lightning_fp8.fp8_state_dict(model)` / "
        "`lightning_fp8.load_fp8_state_dict(model, state)` (the Lightning Trainer's and Accelerate's checkpoints "
        "carry it already).",
        UserWarning, stacklevel=3,
    )


class RoleState:
    """One tensor role's view of a layer's FP8LayerState (`layer.fp8_meta.input`, `.weight`, `.grad_output`).

    `amax_history`, `overflow_count` and `clip_count` are views into the layer's buffers; `scale` and `initialized`
    are derived: the scale the role's next delayed-scaling cast will use under the layer's recipe, and whether the
    role has a completed step to size it from."""

    __slots__ = ("meta", "name", "index")

    def __init__(self, meta: FP8LayerState, role: str) -> None:
        self.meta = meta
        self.name = role
        self.index = ROLE_INDEX[role]

    @property
    def amax_history(self) -> torch.Tensor:
        return self.meta.amax_history[self.index]

    @property
    def overflow_count(self) -> torch.Tensor:
        return self.meta.overflow_count[self.index]

    @property
    def history_sized(self) -> bool:
        """The engine read that this role's history sizes a delayed scale (its delayed casts skip the amax pre-pass);
        False until it has, and after the histories were replaced."""
        return self.meta.history_sized[self.index]

    @property
    def clip_count(self) -> torch.Tensor:
        return self.meta.clip_count[self.index]

    @property
    def initialized(self) -> torch.Tensor:
        recipe = self.meta.recipe
        return reference_amax(self.amax_history, recipe.amax_compute_algo == "max") > 0

    def scale_for(self, recipe: Optional[FP8Recipe] = None) -> torch.Tensor:
        """The scale of the role's next delayed-scaling cast under `recipe` (default: the layer's); 1 for a role
        cast without a scale, and the last completed step's scale for current scaling."""
        recipe = recipe or self.meta.recipe
        if not recipe.uses_scaling_for(self.name):
            return torch.ones((), dtype=torch.float32, device=self.amax_history.device)
        history = self.amax_history
        ref = reference_amax(history, recipe.amax_compute_algo == "max") if recipe.scaling == "delayed" else history[1]
        fmt = recipe.format_for(self.name)
        return scale_from_amax(ref, fmt.max, recipe.margin, 1.0, recipe.power_of_2_scales)

    @property
    def scale(self) -> torch.Tensor:
        return self.scale_for()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """This role's state (views of the layer's buffers) and the derived scale, for inspection."""
        return {
            "amax_history": self.amax_history,
            "overflow_count": self.overflow_count,
            "clip_count": self.clip_count,
            "scale": self.scale,
            "initialized": self.initialized,
        }

    @torch.no_grad()
    def observe_amax(self, amax: torch.Tensor) -> None:
        """Accumulate an amax into the step in progress without a cast (what calibration does)."""
        slot = self.meta.amax_history[self.index, 0]
        slot.copy_(torch.maximum(slot, amax.to(slot.device, torch.float32)))

    def __repr__(self) -> str:
        return f"RoleState({self.name})"

    def __getattr__(self, name: str):
        # torch's RowwiseParallel shards the `weight` of every submodule of the layer it is applied to, the FP8
        # metadata included (`fp8_meta.weight` is this role view): say what to do instead of failing on `is_leaf`
        if name == "is_leaf":
            raise AttributeError(
                "lightning_fp8: torch's RowwiseParallel was applied to an FP8 layer; it shards the `weight` of every "
                "submodule, and the FP8 metadata has no weight to shard. Use lightning_fp8.distributed."
                "FP8RowwiseParallel (same arguments) in its place. Under Fabric's ModelParallelStrategy that is the "
                "only way: Fabric's FP8 plugin converts the model before your parallelize_fn. Elsewhere torch's "
                "RowwiseParallel also works applied before conversion (Lightning converts after configure_model; "
                "plain PyTorch: parallelize_module, then convert_to_fp8)."
            )
        raise AttributeError(f"'RoleState' object has no attribute {name!r}")


_STREAM_ATTRIBUTE = "_lightning_fp8_rng_state"


def _step_constants(recipe: FP8Recipe, device) -> StepConstants:
    """The recipe's constants for closing a step, one value per tensor role (input, weight, grad_output)."""
    roles = len(ROLES)
    return StepConstants(
        fp8_max=torch.tensor([recipe.format_for(r).max for r in ROLES], dtype=torch.float32, device=device),
        scaled=torch.tensor([recipe.uses_scaling_for(r) for r in ROLES], dtype=torch.bool, device=device),
        delayed=torch.tensor([recipe.scaling == "delayed"] * roles, dtype=torch.bool, device=device),
        algo_max=torch.tensor([recipe.amax_compute_algo == "max"] * roles, dtype=torch.bool, device=device),
        margin=torch.tensor([float(recipe.margin)] * roles, dtype=torch.float32, device=device),
        power_of_2=torch.tensor([recipe.power_of_2_scales] * roles, dtype=torch.bool, device=device),
    )


def uses_rounding_stream(recipe: FP8Recipe) -> bool:
    """Whether a recipe's casts draw stochastic rounding's numbers from the layer's own stream (NVFP4 with stochastic
    gradients: the fused cast generates them in-kernel)."""
    return recipe.scaling == "nvfp4" and recipe.rounding_for("grad_output") == "stochastic"


def new_rounding_stream(device=None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A fresh stream state, int64 [seed, offset 0]: the seed drawn from `generator` (torch's default CPU generator:
    one draw, when a layer adopts such a recipe, so that torch.manual_seed makes it reproducible)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64)]).to(device)


def stochastic_rounding_state(history: torch.Tensor, device=None,
                              generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The stream state of the layer whose amax history this is (FP8LayerState.rng_state, mutated by the casts that
    draw from it); a history of no such layer (a cast outside FP8LayerState, an FP8LayerState pickled before the stream
    existed) gets a transient stream seeded from `generator` (torch's default): one draw per cast."""
    stream = getattr(history, _STREAM_ATTRIBUTE, None)
    if stream is not None:
        return stream
    return new_rounding_stream(generator=generator).to(device if device is not None else history.device)


def _resize_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """Keep the newest entries (slot 0 and the most recent completed steps) when the history length changes."""
    if history.shape[-1] >= length:
        return history[..., :length].clone()
    out = torch.zeros(*history.shape[:-1], length, dtype=history.dtype, device=history.device)
    out[..., : history.shape[-1]] = history
    return out


def _upgrade_per_role_layout(state_dict, prefix: str) -> None:
    """Read a state in the older layout of one module per role (`<prefix><role>.amax_history` of length L with slot 0
    the open step, `.scale`, `.initialized`, counters) into the [3, L+1] layout, in place; other states are left as
    they are."""
    old = [f"{prefix}{role}.amax_history" for role in ROLES]
    if not all(key in state_dict for key in old):
        return
    rows = [state_dict.pop(key) for key in old]
    length = max(r.numel() for r in rows)
    history = torch.stack([torch.cat([r, r.new_zeros(length + 1 - r.numel())]) for r in rows])
    history[:, 0] = 0.0  # the open step of a saved state is empty (saved states were taken between steps)
    state_dict[prefix + "amax_history"] = history
    for name in ("overflow_count", "clip_count"):
        keys = [f"{prefix}{role}.{name}" for role in ROLES]
        if all(key in state_dict for key in keys):
            state_dict[prefix + name] = torch.stack([state_dict.pop(key).reshape(()) for key in keys])
    for role in ROLES:
        for name in ("scale", "initialized"):
            state_dict.pop(f"{prefix}{role}.{name}", None)



__getattr__ = renamed_module_names(__name__, {"FP8LinearMeta": ("FP8LayerState", FP8LayerState)})
