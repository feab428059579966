"""Mixture-of-experts layers in FP8: transformers 5's experts modules run FP8 grouped GEMMs on the one GEMM path.

- the grouped GEMM (forward, input gradient, per-expert weight gradient) equals per-expert dense rowwise FP8 layers
  (the same casts and products), has their SQNR against the high-precision GEMMs, and handles uneven and empty
  experts and the expert-parallel sentinel rows;
- the planner's grouped calls for sm90 (and sm100 under the torch release that runs them) pass torch's own meta
  checks, re-lay a grouped contraction's tokens without changing a number, and refuse by name elsewhere;
- Mixtral, Qwen3-MoE, DeepSeek-V3 (shared experts) and gpt-oss (expert biases, transposed storage): experts in FP8,
  routers never, every projection in the precision map with its FLOPs per token, the summary's share counting them,
  state_dict keys and exports unchanged, revert; models built on the meta device load right; an experts module the
  rules cannot read is listed as BF16 with its reason.
Training runs (the Lightning plugin with a resume, transformers' Trainer on Accelerate): tests/test_moe_training.py.
"""
import dataclasses
import warnings

import pytest
import torch
from support.moe_models import CONFIGS, moe_model
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe, convert_to_fp8, precision_map, revert_fp8
from lightning_fp8.conversion.summary import conversion_summary
from lightning_fp8.kernels.device import simulate_cuda
from lightning_fp8.modules.cast import caster_for
from lightning_fp8.modules.emulation import emulate_grouped
from lightning_fp8.modules.grouped_linear import IMPLEMENTATION, FP8GroupedLinear
from lightning_fp8.modules.linear_gemms import GemmConfig, linear_gemms
from lightning_fp8.modules.gemm import record_gemms
from lightning_fp8.modules.operand import FP8Matrix, GemmRequest
from lightning_fp8.modules.scaled_mm import (
    GROUP_ALIGNMENT,
    GROUPED_CONTRACTION,
    GROUPED_ROWS,
    Refusal,
    ScaledGroupedMMCall,
    check_call,
    plan_scaled_mm,
    target_for,
)
from tests.support.helpers import sqnr_db

ROWWISE_E4M3 = FP8Recipe(format="e4m3", scaling="rowwise")
E, N, K = 4, 48, 32
#: expert token counts: uneven, one empty expert, and 3 rows routed to no local expert (expert parallelism's sentinel)
COUNTS = [5, 0, 19, 3]
SENTINEL_ROWS = 3


def _grouped_step(x, weight, counts, out_dtype=torch.float32):
    """One FP8 forward + backward of the grouped GEMM y[rows of e] = x[rows] W_e^T (the experts' path), with the
    upstream gradient of ones times a fixed pattern: (y, dx, dW, recorded GEMM requests)."""
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    history = torch.zeros(3, 17)
    caster = caster_for(ROWWISE_E4M3, offsets)
    with record_gemms() as requests:
        x_cast = caster.cast(x, history, "input", True, layouts=(True, True))
        w_cast = caster.cast(weight, history, "weight", True, layouts=(True, False))
        y = linear_gemms(x, weight, None, x_cast, w_cast, history, None, GemmConfig(ROWWISE_E4M3, out_dtype, True),
                         offsets=offsets)
        y.backward(_upstream(y))
    return y.detach(), x.grad, weight.grad, requests


def _upstream(y):
    g = torch.Generator().manual_seed(7)
    return torch.randn(y.shape, generator=g).to(y.dtype)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS) + SENTINEL_ROWS, K, generator=g)
    x[3] *= 50.0  # an outlier token: rowwise scaling keeps it to its own row
    weight = torch.randn(E, N, K, generator=g) / K**0.5
    return x, weight


def _per_expert_dense(x, weight, counts):
    """The same computation as E dense rowwise FP8 layers, one per expert on its tokens; the sentinel rows none."""
    ys, dxs, dws = [], [], []
    start = 0
    for e, count in enumerate(counts):
        layer = FP8Linear(K, N, bias=False, recipe=ROWWISE_E4M3)
        with torch.no_grad():
            layer.weight.copy_(weight[e])
        rows = x[start:start + count].detach().clone().requires_grad_()
        y = layer(rows) if count else torch.zeros(0, N)
        if count:
            y.backward(_upstream_rows(start, count))
        ys.append(y.detach())
        dxs.append(rows.grad if count else torch.zeros(0, K))
        dws.append(layer.weight.grad if count else torch.zeros(N, K))
        start += count
    tail = torch.zeros(SENTINEL_ROWS, N)
    return torch.cat(ys + [tail]), torch.cat(dxs + [torch.zeros(SENTINEL_ROWS, K)]), torch.stack(dws)


def _upstream_rows(start, count):
    full = _upstream(torch.zeros(sum(COUNTS) + SENTINEL_ROWS, N))
    return full[start:start + count]


# -- the grouped GEMM -------------------------------------------------------------------------------------------------
def test_the_grouped_gemms_equal_one_dense_rowwise_fp8_layer_per_expert():
    """Forward, input gradient and weight gradient of the grouped path = E dense rowwise FP8 layers (same casts, same
    products: equal up to float32 summation order); the empty expert's gradient and the sentinel rows are zeros."""
    x, weight = _data()
    y, dx, dw, _ = _grouped_step(x, weight, COUNTS)
    y_ref, dx_ref, dw_ref = _per_expert_dense(x, weight, COUNTS)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not dw[1].any()  # expert 1 got no token
    assert not y[-SENTINEL_ROWS:].any() and not dx[-SENTINEL_ROWS:].any()


def test_sqnr_of_the_three_grouped_gemms_is_the_dense_rowwise_one():
    """Against the high-precision grouped GEMM (float32): forward, input and weight gradient each have the SQNR of
    rowwise e4m3 (about 29 dB: E4M3's 3 mantissa bits), and that of the dense layers to within 0.01 dB."""
    x, weight = _data(seed=1)
    y, dx, dw, _ = _grouped_step(x, weight, COUNTS)
    y_ref, dx_ref, dw_ref = _per_expert_dense(x, weight, COUNTS)
    xr, wr = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    start, outs = 0, []
    for e, count in enumerate(COUNTS):
        outs.append(xr[start:start + count] @ wr[e].t())
        start += count
    exact = torch.cat(outs + [xr[-SENTINEL_ROWS:].sum() * 0 + torch.zeros(SENTINEL_ROWS, N)])
    exact.backward(_upstream(exact))
    for got, dense, want in ((y, y_ref, exact.detach()), (dx, dx_ref, xr.grad), (dw, dw_ref, wr.grad)):
        db = sqnr_db(want, got)
        assert 27.0 < db < 32.0, db
        assert abs(db - sqnr_db(want, dense)) < 0.01


def test_the_grouped_requests_are_grouped_rows_twice_and_one_grouped_contraction():
    x, weight = _data()
    _, _, _, requests = _grouped_step(x, weight, COUNTS)
    assert [request.grouped for request in requests] == ["rows", "rows", "contraction"]
    forward, dgrad, wgrad = requests
    assert forward.b.data.shape == (E, K, N) and forward.b.data.stride(-2) == 1  # W_e^T column-major, no copy
    assert dgrad.b.data.shape == (E, N, K) and dgrad.b.data.stride(-2) == 1
    assert wgrad.a.scale_inv.shape == (E, N, 1) and wgrad.b.scale_inv.shape == (E, 1, K)  # per (expert, column)


# -- the planner ----------------------------------------------------------------------------------------------------------
def _requests(out_dtype=torch.bfloat16):
    x, weight = _data()
    return _grouped_step(x, weight, COUNTS, out_dtype)[3]


@pytest.mark.parametrize("capability,torch_version", [((9, 0), None), ((10, 0), (2, 14))])
def test_planned_grouped_calls_pass_torchs_own_checks(capability, torch_version):
    """Every grouped call of a training step, planned for sm90 (and sm100 under torch 2.14's rules), replayed on meta
    tensors: torch._scaled_grouped_mm's meta checks (dtypes, layouts, scale shapes, offsets) pass, the output has the
    request's shape, and check_call (what meta tensors cannot show) finds nothing."""
    target = target_for(capability, torch_version)
    for request in _requests():
        call = plan_scaled_mm(request, target)
        assert isinstance(call, ScaledGroupedMMCall), call
        assert call.kind == (GROUPED_ROWS if request.grouped == "rows" else GROUPED_CONTRACTION)
        out = call.on_meta().launch()
        want = (request.a.data.shape[0], request.b.data.shape[-1]) if request.grouped == "rows" else (
            E, request.a.data.shape[0], request.b.data.shape[1])
        assert tuple(out.shape) == want and out.dtype == torch.bfloat16
        assert check_call(call) == []


def test_the_planned_contraction_re_lays_the_tokens_16_aligned_without_changing_a_number():
    """The weight-gradient call re-lays each expert's tokens to start at a multiple of 16 (zero padding): emulating the
    planned operands with the planned offsets gives exactly what the request's own emulation gives."""
    wgrad = _requests()[2]
    call = plan_scaled_mm(wgrad, target_for((9, 0)))
    offsets = call.offs.tolist()
    starts = [0] + offsets[:-1]
    assert all(start % GROUP_ALIGNMENT == 0 for start in starts)
    assert [end - start for start, end in zip(starts, offsets)] == [16, 0, 32, 16]
    planned = GemmRequest(FP8Matrix(call.mat_a, call.scale_a.view(E, -1, 1), (1, 0)),
                           FP8Matrix(call.mat_b, call.scale_b.view(E, 1, -1), (0, 1)), torch.bfloat16,
                           offsets=call.offs)
    assert torch.equal(emulate_grouped(planned), emulate_grouped(wgrad))


def test_grouped_calls_are_refused_by_name_where_torch_has_no_grouped_kernel():
    forward = _requests()[0]
    for capability, torch_version, words in (((8, 9), None, "sm89"), ((12, 0), None, "sm120"),
                                             ((10, 0), (2, 13), "sm100 in torch 2.13")):
        plan = plan_scaled_mm(forward, target_for(capability, torch_version))
        assert isinstance(plan, Refusal) and words in plan.reason, plan
    float32 = _requests(out_dtype=torch.float32)[0]
    plan = plan_scaled_mm(float32, target_for((9, 0)))
    assert isinstance(plan, Refusal) and "writes bf16 only" in plan.reason


def test_on_a_simulated_sm90_the_step_runs_the_planned_calls_emulated_and_equals_the_cpu_step():
    """With a simulated sm90 the layer plans every grouped call (no CPU kernel runs them: emulated after planning):
    the numbers are the CPU path's."""
    x, weight = _data()
    y_cpu, dx_cpu, dw_cpu, _ = _grouped_step(x, weight, COUNTS, torch.bfloat16)
    with simulate_cuda((9, 0)):
        y, dx, dw, requests = _grouped_step(x, weight, COUNTS, torch.bfloat16)
    assert len(requests) == 3
    assert torch.equal(y, y_cpu) and torch.equal(dx, dx_cpu) and torch.equal(dw, dw_cpu)


# -- models -----------------------------------------------------------------------------------------------------------
MODELS = list(CONFIGS)


def _converted(name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_fp8(moe_model(name), verbose=False, **kwargs)


@pytest.mark.parametrize("name", MODELS)
def test_experts_convert_routers_do_not_and_the_map_and_summary_count_them(name):
    model = _converted(name)
    rows = precision_map(model)
    experts = [row for row in rows if row.family == "experts"]
    routers = [row for row in rows if row.family == "router"]
    assert len(experts) == 4 and all(row.precision == "fp8" and row.scaling == "rowwise" for row in experts)
    assert len(routers) == 2 and all(row.precision == "bf16" and row.reason.startswith("router") for row in routers)
    first = next(row for row in experts if row.fqn.endswith(".gate_up"))
    assert first.flops_per_token == 2 * 64 * 96  # top-2 x one expert's 64 -> 2 x 48
    layer = model.get_submodule(first.fqn)
    assert isinstance(layer, FP8GroupedLinear) and layer.fp8_enabled
    assert model.get_submodule(first.fqn.rsplit(".", 1)[0]).config._experts_implementation == IMPLEMENTATION
    text = conversion_summary(model).text()
    assert "4 of 4 expert GEMMs" in text and "of the GEMM work per token in FP8" in text
    if name == "deepseek_v3":  # its shared expert is a plain MLP: linear layers in FP8
        assert any(row.precision == "fp8" and ".shared_experts." in row.fqn for row in rows)


@pytest.mark.parametrize("name", MODELS)
def test_a_converted_model_computes_close_to_bf16_and_keeps_its_state_dict_keys(name):
    reference = moe_model(name)
    keys = list(reference.state_dict())
    model = _converted(name)
    assert list(model.state_dict()) == keys
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    reference.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
        ref = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.01
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_revert_gives_the_experts_back_their_implementation():
    model = _converted("mixtral")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up, FP8GroupedLinear)
    revert_fp8(model)
    assert not any(isinstance(m, FP8GroupedLinear) for m in model.modules())
    assert experts.config is model.config and experts.config._experts_implementation != IMPLEMENTATION


def test_save_pretrained_after_fp8_training_loads_into_a_plain_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _converted("qwen3_moe")
    ids = torch.randint(1, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    model.save_pretrained(tmp_path)
    plain, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_a_meta_built_moe_model_loads_and_computes_as_one_built_on_the_cpu():
    reference = _converted("mixtral")
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    with torch.device("meta"):
        model = moe_model("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = convert_to_fp8(model, verbose=False, example_input=torch.zeros(1, 4, dtype=torch.long))
    model.load_state_dict(weights, assign=True)
    # the rotary embedding's frequencies are a non-persistent buffer (no checkpoint holds them; transformers'
    # from_pretrained computes them): taken from the reference, as the model's own loading would
    model.model.rotary_emb.inv_freq = reference.model.rotary_emb.inv_freq.clone()
    model.model.rotary_emb.original_inv_freq = reference.model.rotary_emb.original_inv_freq.clone()
    layers = [m for m in model.modules() if isinstance(m, FP8GroupedLinear)]
    assert len(layers) == 4 and not any(layer.fp8_meta.is_meta for layer in layers)
    assert all(not layer.fp8_meta.amax_history.any() for layer in layers)
    ids = torch.randint(1, 128, (2, 16))
    model.train()
    reference.train()
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_recipe_without_a_grouped_gemm_keeps_the_experts_in_bf16_and_warns():
    with pytest.warns(UserWarning, match="mixture-of-experts work per token stays in BF16"):
        model = convert_to_fp8(moe_model("mixtral"), FP8Recipe(scaling="blockwise", format="e4m3"))
    experts = [row for row in precision_map(model) if row.family == "experts"]
    assert experts and all(row.precision == "bf16" and "no grouped FP8 GEMM" in row.reason for row in experts)
    assert model.model.layers[0].mlp.experts.config._experts_implementation != IMPLEMENTATION


def test_layer_recipes_and_filters_decide_experts_too():
    model = _converted("mixtral", layer_recipes={"model.layers.1.*": FP8Recipe(scaling="blockwise", format="e4m3")})
    rows = {row.fqn: row for row in precision_map(model)}
    assert rows["model.layers.0.mlp.experts.gate_up"].precision == "fp8"
    assert rows["model.layers.1.mlp.experts.gate_up"].precision == "bf16"
    filtered = _converted("mixtral", module_filter=lambda module, fqn: "experts" not in fqn)
    assert all(row.precision == "bf16" and row.reason == "excluded by module_filter"
               for row in precision_map(filtered) if row.family == "experts")


def test_the_preview_lists_experts_as_would_fp8_with_their_flops():
    rows = [row for row in precision_map(moe_model("gpt_oss")) if row.family == "experts"]
    assert [row.precision for row in rows] == ["would-fp8"] * 4
    assert {row.flops_per_token for row in rows} == {2 * 64 * 96, 2 * 48 * 64}


class _ResearchExperts(nn.Module):
    """An experts module in no library's layout: 3-D weights and a loop of its own."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 64, 32))
        self.w_out = nn.Parameter(torch.randn(4, 32, 64))

    def forward(self, x):
        return torch.einsum("td,edh,ehk->tk", x, self.w_in, self.w_out) / 4


class _OldMoE(nn.Module):
    """transformers-4-style MoE: a linear router and a ModuleList of per-expert MLPs."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 64)) for _ in range(4))
        self.research = _ResearchExperts()


def test_unreadable_experts_stay_bf16_with_their_reason_and_module_list_experts_convert_as_linears():
    model = nn.Sequential(nn.Linear(64, 64), _OldMoE(), nn.Linear(64, 64))
    model = convert_to_fp8(model, verbose=False, module_filter=None)
    rows = {row.fqn: row for row in precision_map(model)}
    assert rows["1.research"].precision == "bf16" and "cannot read" in rows["1.research"].reason
    assert rows["1.gate"].precision == "bf16" and rows["1.gate"].reason.startswith("router")
    assert rows["1.experts.0.0"].precision == "fp8" and rows["1.experts.3.2"].precision == "fp8"


def test_grouped_recipe_keeps_the_recipes_choices_in_e4m3_rowwise():
    from lightning_fp8.modules.grouped_linear import grouped_recipe

    recipe, why = grouped_recipe(FP8Recipe(margin=1, amax_history_len=4, weight_grad="high_precision"))
    assert why is None
    assert (recipe.scaling, recipe.format, recipe.margin, recipe.amax_history_len, recipe.weight_grad) == (
        "rowwise", "e4m3", 1, 4, "high_precision")
    recipe, _ = grouped_recipe(FP8Recipe(backend="h100"))
    assert recipe.backend == "auto"  # the H100 model covers per-tensor GEMMs only
    assert dataclasses.replace(recipe) == recipe


# -- the ops ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("simulated", [None, (9, 0)])
def test_the_grouped_ops_match_their_fake_impls(simulated):
    """torch.library.opcheck of the grouped cast (the per-(expert, column) cast, uneven groups with an empty one and
    rows past the last offset) and of fp8_gemm with offsets (both grouped kinds), on the CPU path and on a simulated
    sm90 (where the planned calls are emulated): what torch.compile and the meta replay plan with."""
    import contextlib

    offsets = torch.tensor([10, 10, 40], dtype=torch.int32)
    x = torch.randn(48, 80)
    with simulate_cuda(simulated) if simulated else contextlib.nullcontext():
        torch.library.opcheck(torch.ops.lightning_fp8.grouped_cast.default,
                              (x, torch.zeros(3, 5), 0, "e4m3", offsets, 0, True, None, True),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))
        forward, _, wgrad = _requests()
        for request in (forward, wgrad):
            a, b = request.a, request.b
            args = (a.data, a.scale_inv, list(a.tile), None, b.data, b.scale_inv, list(b.tile), None,
                    request.out_dtype, None, False, "auto", False, request.offsets)
            torch.library.opcheck(torch.ops.lightning_fp8.fp8_gemm.default, args,
                                  test_utils=("test_autograd_registration", "test_faketensor",
                                              "test_aot_dispatch_dynamic"))


# -- the Triton grouped cast --------------------------------------------------------------------------------------------
import importlib.util  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"
interp = pytest.mark.skipif(not INTERPRETING or not HAS_TRITON or torch.cuda.is_available(),
                            reason="runs inside test_grouped_cast_interpreter_part (TRITON_INTERPRET=1 from the start)")


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING or torch.cuda.is_available(),
                    reason="needs triton and no GPU; runs the interp_ tests of this file")
def test_grouped_cast_interpreter_part():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k",
                          "interp_"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]


def _edge_rows(rows, cols, seed):
    """Values across E4M3's range with ties, subnormals, the format's max, inf and NaN in some groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, cols), generator=g).float())
    x[1, :4] = torch.tensor([448.0, -448.0, 2.0**-9, 3.0 * 2.0**-10])
    x[7, 5] = float("inf")
    x[30, 9] = float("nan")
    return x


@interp
@pytest.mark.parametrize("layout", ["row", "t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_the_grouped_cast_kernel_is_the_reference_bit_for_bit(layout, dtype):
    """The Triton kernel (the interpreter, exact integer rounding) against the torch definition: uneven experts, an
    empty one, rows past the last offset, inf / NaN in single experts, a transposed input; codes, scales and the amax
    record equal to the bit."""
    from lightning_fp8.kernels import kernel_reference
    from lightning_fp8.kernels.triton_grouped import launch_grouped_cast
    from lightning_fp8.numerics.formats import E4M3

    base = _edge_rows(150, 100, seed=3)
    x = (base if layout == "row" else base.t().contiguous().t()).to(dtype)
    offsets = torch.tensor([20, 20, 31, 90, 140], dtype=torch.int32)
    history_ref, history = torch.zeros(3, 5), torch.zeros(3, 5)
    q_ref, s_ref = kernel_reference.grouped_cast_reference(x, history_ref, 2, E4M3, offsets, 0, True)
    codes, scales = launch_grouped_cast(x, history[2, 0:1], E4M3, offsets, 0, True, hw_cast=False)
    assert torch.equal(codes, q_ref.view(torch.uint8))
    assert torch.equal(scales, s_ref)
    assert torch.equal(history.isnan(), history_ref.isnan())
    assert torch.equal(history.nan_to_num(), history_ref.nan_to_num())


def test_a_grouped_step_on_sm90_launches_the_fused_grouped_cast_and_reads_nothing_on_the_host():
    """One training step of an experts projection on meta tensors under a simulated sm90 with the Triton casts
    (kernels/trace.py): the per-(expert, column) casts are one launch each (x^T in the forward; dy^T and the weight's
    per-expert transpose in the backward), the GEMMs the three planned grouped calls, and no value is read on the
    host. The budget this pins (benchmarks/results/moe.md prices it)."""
    pytest.importorskip("triton")
    from lightning_fp8.engine.host_reads import count_host_reads
    from lightning_fp8.kernels.trace import record_launches
    from lightning_fp8.modules.grouped_linear import ExpertsLayout, Projection, grouped_recipe

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.down_proj = nn.Parameter(torch.empty(8, 256, 128, device="meta", dtype=torch.bfloat16))

    layout = ExpertsLayout(8, (Projection("down_proj", None, "down"),) * 2, False, 2, "Experts")
    with simulate_cuda((9, 0), triton=True), count_host_reads() as reads:
        layer = FP8GroupedLinear(Experts(), layout, layout.projections[0], grouped_recipe(FP8Recipe())[0])
        layer.closes_own_steps = False
        x = torch.empty(4096, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
        offsets = torch.empty(8, device="meta", dtype=torch.int32)
        with record_launches() as forward:
            y = layer(x, offsets)
        grad = torch.empty_like(y)
        with record_launches() as backward:
            y.backward(grad)
    names = [launch.name for launch in forward] + [launch.name for launch in backward]
    assert names.count("grouped_colwise") == 3 and names.count("_scaled_grouped_mm") == 3
    assert list(reads) == []
    assert len(forward) <= GROUPED_FORWARD_BUDGET and len(backward) <= GROUPED_BACKWARD_BUDGET, (
        [launch.name for launch in forward], [launch.name for launch in backward])


#: kernels of one experts projection's training step on sm90 under the engine (the test above), as reached: forward 9
#: (rowwise x, grouped x^T, rowwise W, the GEMM, 5 to zero the rows past the last offset); backward 52 (rowwise dy,
#: grouped dy^T, W^T per expert grouped plus its packing copy, two GEMMs with their zeroing, and the weight-gradient
#: GEMM's 16-aligned token layout: about 30 small index computations on E- or T-long vectors and one gather per
#: operand). Transformer Engine's dense structure is 6; what is above it costs a few microseconds each except the
#: gathers and the zeroing passes (benchmarks/results/moe.md prices them)
GROUPED_FORWARD_BUDGET, GROUPED_BACKWARD_BUDGET = 9, 52


@pytest.mark.parametrize("arch", [90, 100])
def test_the_grouped_cast_kernel_compiles_for_hopper_and_blackwell(monkeypatch, arch):
    """Triton's whole pipeline and the bundled ptxas for sm90 / sm100, for both conversions (the hardware cvt and the
    exact integer rounding) and the input dtypes an experts layer casts (tests/test_triton_compile.py's machinery)."""
    pytest.importorskip("triton")
    compile_tests = pytest.importorskip("test_triton_compile")
    from lightning_fp8.kernels import triton_grouped
    from lightning_fp8.numerics.formats import E4M3

    for dtype in (torch.bfloat16, torch.float32):  # (nothing runs: the launches are recorded, then compiled)
        x, offsets, history = torch.zeros(64, 32, dtype=dtype), torch.tensor([9, 9, 40, 60], dtype=torch.int32), \
            torch.zeros(3, 5)
        for hw in (True, False):
            variants = compile_tests.record(monkeypatch, triton_grouped, "_grouped_colwise_kernel",
                                            lambda: triton_grouped.launch_grouped_cast(x, history[2, 0:1], E4M3,
                                                                                       offsets, 0, True, hw_cast=hw))
            assert len(variants) == 1
            compile_tests.ptx_of(variants[0], arch)
