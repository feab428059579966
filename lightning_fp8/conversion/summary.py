"""The conversion summary: how much of the model's linear and convolution work runs in FP8, what stays in BF16 and why.

Logged once when a model is converted (by `convert_to_fp8`, and by every adapter at fit start through the
framework's logging), so nobody trains in BF16 believing it is FP8; once per model: the same summary is not logged a
second time for the same model (`log_conversion_summary(once=True)`). The measure is linear FLOPs per token: the sum
of in x out over the linear layers (the same per-token factor multiplies every layer, so the share is the share of
the model's linear GEMM work). Convolutions are counted on their own line, in multiply-adds per output position
(C/groups x kernel x out channels): their layers see feature maps of different sizes, so this share weighs a layer by
its per-position cost, not by its share of an image's work. A warning names the module types found when nothing or
little of the GEMM work (linear, convolution and recurrent layers together) converts.
"""
from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from torch import nn

from lightning_fp8.engine.batchnorm_stats import batchnorm_layers
from lightning_fp8.conversion.convert import LayerPrecision, precision_map

#: set on a module by lightning_fp8.distributed.PrepareFP8ModuleInput (conversion must not import distributed)
PREPARED_ATTR = "_fp8_prepared_input"

log = logging.getLogger("lightning_fp8")

#: below this share of linear FLOPs in FP8 the summary warns
LITTLE_FP8_SHARE = 0.5
#: layer names shown per reason before "(+N more)"
NAMES_PER_REASON = 4

LEAVING_FP8 = ("The model stays converted after training; lightning_fp8.revert_fp8(model) turns its FP8 layers back "
               "into the original classes (same Parameters) for inference or export.")

BATCHNORM_HINT = ("{n} BatchNorm layers: eval mode normalises with running statistics, which trail the weights at a "
                  "constant or slowly decaying learning rate (in BF16 as much as in FP8) and can cost eval-mode "
                  "accuracy; lightning_fp8.callbacks.BatchNormRefresh (or refresh_batchnorm) re-estimates them "
                  "(docs/numerics.md, Eval-mode quality).")


@dataclass(frozen=True)
class ConversionSummary:
    rows: List[LayerPrecision]
    module_types: Dict[str, int]  # class name -> count, for modules that hold parameters
    #: modules whose sequence-parallel input PrepareFP8ModuleInput all-gathers (in FP8 where their first layer is)
    fp8_prepared: List[str] = field(default_factory=list)
    #: how the recipe was chosen (recipe="auto": the device and why), shown after the counts
    note: Optional[str] = None
    #: BatchNorm layers that keep running statistics (eval mode normalises with them)
    batchnorm_layers: int = 0

    @property
    def linear_rows(self) -> List[LayerPrecision]:
        return [r for r in self.rows if r.flops_per_token and r.family == "linear"]

    @property
    def experts_rows(self) -> List[LayerPrecision]:
        """The grouped GEMMs of the mixture-of-experts layers (one row per projection of each experts module)."""
        return [r for r in self.rows if r.family == "experts"]

    @property
    def experts_fp8_share(self) -> float:
        """The share of the experts' multiply-adds per token (top-k routed) in FP8."""
        total = sum(r.flops_per_token for r in self.experts_rows)
        return sum(r.flops_per_token for r in self.experts_rows if r.fp8) / total if total else 0.0

    @property
    def token_gemm_rows(self) -> List[LayerPrecision]:
        """What a token's forward multiplies: the linear layers, the routed experts' GEMMs and the routers."""
        return [r for r in self.rows if r.family in ("linear", "experts", "router")]

    @property
    def conv_rows(self) -> List[LayerPrecision]:
        """Every convolution, FP8 or not (transposed and 3-D ones included, with 0 multiply-adds counted)."""
        return [r for r in self.rows if r.family == "convolution"]

    @property
    def fp8_flops(self) -> int:
        return sum(r.flops_per_token for r in self.rows if r.fp8 and r.family == "linear")

    @property
    def linear_flops(self) -> int:
        return sum(r.flops_per_token for r in self.rows if r.family == "linear")

    @property
    def fp8_share(self) -> float:
        """The share of linear FLOPs per token in FP8."""
        return self.fp8_flops / self.linear_flops if self.linear_flops else 0.0

    @property
    def conv_fp8_flops(self) -> int:
        return sum(r.flops_per_token for r in self.conv_rows if r.fp8)

    @property
    def conv_flops(self) -> int:
        return sum(r.flops_per_token for r in self.conv_rows)

    @property
    def gemm_fp8_share(self) -> float:
        """The share in FP8 of all GEMM multiply-adds counted (linear per token, convolution per output position,
        recurrent per token): what the warning reads."""
        total = sum(r.flops_per_token for r in self.rows)
        fp8 = sum(r.flops_per_token for r in self.rows if r.fp8)
        return fp8 / total if total else 0.0

    @property
    def preview(self) -> bool:
        return any(r.preview for r in self.rows)

    def text(self) -> str:
        linear = self.linear_rows
        convs = self.conv_rows
        n_fp8 = sum(1 for r in linear if r.fp8)
        verb = "would run" if self.preview else "run"
        lines = []
        if linear or not convs:
            lines.append(
                f"lightning_fp8: {n_fp8} of {len(linear)} linear layers {verb} in FP8: {self.fp8_share:.1%} of linear "
                f"FLOPs (per token: {self.fp8_flops:,} of {self.linear_flops:,} multiply-adds)."
            )
        experts = self.experts_rows
        if experts:
            n_experts = sum(1 for r in experts if r.fp8)
            token_rows = self.token_gemm_rows
            total = sum(r.flops_per_token for r in token_rows)
            fp8 = sum(r.flops_per_token for r in token_rows if r.fp8)
            lines.append(
                f"lightning_fp8: {n_experts} of {len(experts)} expert GEMMs (grouped, per projection of each experts "
                f"module) {verb} in FP8: {self.experts_fp8_share:.1%} of the experts' FLOPs per token (the top-k "
                f"experts a token is routed to). With the linear layers and routers: {fp8 / total if total else 0:.1%} "
                f"of the GEMM work per token in FP8 ({fp8:,} of {total:,} multiply-adds)."
            )
        if convs:
            n_conv = sum(1 for r in convs if r.fp8)
            share = self.conv_fp8_flops / self.conv_flops if self.conv_flops else 0.0
            lines.append(
                f"lightning_fp8: {n_conv} of {len(convs)} convolutions {verb} in FP8: {share:.1%} of convolution "
                f"multiply-adds per output position ({self.conv_fp8_flops:,} of {self.conv_flops:,})."
            )
        if self.note:
            lines.append(f"  {self.note}")
        recipes = Counter(r.recipe for r in self.rows if r.fp8 and r.recipe)
        if len(recipes) > 1 or (recipes and self.note):
            lines.append("  recipes: " + ", ".join(f"{label} ({count} layers)" for label, count in recipes.items()))
        foreign = [r for r in self.rows if r.precision == "fp8" and not r.reason.startswith("converted") and not r.preview]
        if foreign:
            lines.append(f"  {len(foreign)} of them converted by another library: {_names([r.fqn for r in foreign])}")
        by_reason: Dict[str, List[str]] = {}
        for row in self.rows:
            if not row.fp8:
                by_reason.setdefault(row.reason, []).append(row.fqn or "<the model>")
        if by_reason:
            lines.append("  kept in BF16:")
            for reason, names in by_reason.items():
                lines.append(f"    {_names(names)}: {reason}")
        lines.extend(self.tensor_parallel_lines())
        if self.batchnorm_layers and not self.preview:
            lines.append("  " + BATCHNORM_HINT.format(n=self.batchnorm_layers))
        if not self.preview:
            lines.append("  " + LEAVING_FP8)
        return "\n".join(lines)

    def tensor_parallel_lines(self) -> List[str]:
        """How tensor parallelism splits the linear layers, grouped by layout and style ([] without it): which
        layers communicate in FP8 (lightning_fp8.distributed's styles) and which in high precision (torch's)."""
        by_layout: Dict[str, List[str]] = {}
        for row in self.rows:
            if row.parallel:
                by_layout.setdefault(row.parallel, []).append(f"{row.fqn} ({'FP8' if row.fp8 else 'BF16'})")
        if not by_layout:
            return []
        count = sum(len(names) for names in by_layout.values())
        lines = [f"  tensor parallel: {count} linear layers"]
        for layout, names in by_layout.items():
            lines.append(f"    {layout}: {_names(names)}")
        if self.fp8_prepared:
            lines.append(f"    inputs all-gathered by PrepareFP8ModuleInput (FP8 where the module's first linear layer "
                         f"computes in FP8 with per-tensor scaling): {_names(self.fp8_prepared)}")
        return lines

    def warning(self) -> Optional[str]:
        """A warning when nothing or little of the model runs in FP8, naming what the model is made of, or when its
        mixture-of-experts layers (most of a MoE model's GEMM work) stay in BF16."""
        share = self.gemm_fp8_share
        if share >= LITTLE_FP8_SHARE:
            return self.experts_warning()
        found = ", ".join(f"{name} x{count}" for name, count in self.module_types.items()) or "no module with parameters"
        if share:
            head = f"only {share:.1%} of the GEMM multiply-adds " + ("would run" if self.preview else "run")
        else:
            head = "no layer " + ("would run" if self.preview else "runs")
        experts = self.experts_warning()
        return (
            f"lightning_fp8: {head} in FP8. The model is made of: {found}. FP8 covers linear layers "
            "(nn.Linear, transformers' Conv1D, nn.MultiheadAttention's projections), convolutions (nn.Conv1d, "
            "nn.Conv2d) and the experts of mixture-of-experts layers (transformers' experts modules); the other "
            "modules run in BF16. See precision_map(model) for the reason of every layer."
            + (f" {experts[len('lightning_fp8: '):]}" if experts else "")
        )

    def experts_warning(self) -> Optional[str]:
        """A warning when most of the experts' work per token stays in BF16, with the reasons."""
        experts = self.experts_rows
        if not experts or self.experts_fp8_share >= LITTLE_FP8_SHARE:
            return None
        reasons = sorted({r.reason for r in experts if not r.fp8})
        verb = "would stay" if self.preview else "stays"
        return (f"lightning_fp8: {1 - self.experts_fp8_share:.1%} of the mixture-of-experts work per token {verb} in "
                f"BF16 ({sum(1 for r in experts if not r.fp8)} of {len(experts)} expert GEMMs): "
                + "; ".join(reasons[:3]) + ". See precision_map(model).")


def conversion_summary(model: nn.Module, note: Optional[str] = None) -> ConversionSummary:
    """The summary of a converted model (or, for a model not converted yet, of what conversion would do)."""
    types: Counter = Counter()
    for module in model.modules():
        if any(p is not None for p in module._parameters.values()):
            types[type(module).__name__] += 1
    prepared = [fqn for fqn, module in model.named_modules() if PREPARED_ATTR in module.__dict__]
    return ConversionSummary(precision_map(model), dict(types.most_common()), prepared, note,
                             len(batchnorm_layers(model)))


def log_conversion_summary(
    model: nn.Module,
    info: Optional[Callable[[str], None]] = None,
    warn: Optional[Callable[[str], None]] = None,
    note: Optional[str] = None,
    once: bool = True,
) -> ConversionSummary:
    """Log the summary (`info`, default: logger "lightning_fp8" at INFO) and its warning (`warn`, default:
    warnings.warn), e.g. through a framework's rank-zero logging; returns it. `note`: how the recipe was chosen.

    once: a summary this model logged already, word for word, is not logged again: `convert_to_fp8` called twice, an
    adapter preparing a model `convert_to_fp8` converted, two Accelerators (or `prepare` twice) on one model each say
    what the first said. A changed conversion (layers added, a fallback, tensor parallelism applied) logs again."""
    from lightning_fp8.conversion.convert import SUMMARY_LOGGED_ATTR

    summary = conversion_summary(model, note)
    text = summary.text()
    if once and model.__dict__.get(SUMMARY_LOGGED_ATTR) == text:
        return summary
    model.__dict__[SUMMARY_LOGGED_ATTR] = text
    (info or log.info)(text)
    message = summary.warning()
    if message is not None:
        if warn is None:
            warnings.warn(message, UserWarning, stacklevel=3)
        else:
            warn(message)
    return summary


def _names(names: List[str]) -> str:
    shown = ", ".join(names[:NAMES_PER_REASON])
    return shown + (f" (+{len(names) - NAMES_PER_REASON} more)" if len(names) > NAMES_PER_REASON else "")
