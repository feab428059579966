"""Tensor and sequence parallelism in FP8 on 2 CPU ranks (gloo, one tensor-parallel group of 2):
tests/workers/tensor_parallel_worker.py runs every scenario in one launch, these tests read what each rank wrote.

TP=2 against one rank (`TP_VS_SINGLE_RTOL`): the FP8 operands are the same bytes on both (every history, hence every
delayed scale, is the whole tensor's: the engine's MAX all-reduce of the amaxes; a first-iteration cast without
history reads the slice's amax, which with power-of-two scales lands in the same binade here). What differs is the
row-wise layers' sum: each rank's GEMM writes its partial product in the compute dtype and the ranks add those, where
one rank rounds the whole sum once. Under BF16 autocast that is two BF16 roundings more per output element (about
2^-8 relative each), which the following steps carry on: measured 5.5e-4 relative on the losses of 6 steps (LR
decaying to zero; 1.1e-3 over 12), bound 3e-3. In float32 the partial sums are float32: measured 0 over 6 steps
(1.1e-7 over 12), bound 1e-6 (the order of float32 summation only), which shows the FP8 side contributes nothing.
"""
import os

import pytest
import torch
from support.torchrun_launch import run_workers

WORKER = os.path.join(os.path.dirname(__file__), "workers", "tensor_parallel_worker.py")
#: relative difference of the TP=2 losses from one rank's (see the module docstring), per compute dtype
TP_VS_SINGLE_RTOL = {"bf16": 3e-3, "fp32": 1e-6}
#: the faults the worker injects (engine steps), where no collective carries them to the other rank (so every rank
#: takes them only through the engine's cross-rank agreement): rank 0's loss NaN at step 2 (a skip and a rollback),
#: an inf in rank 1's gradient of a replicated weight at step 4 (a skip)
SKIPS, ROLLBACKS = [2, 4], [2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel")
    proc = run_workers(WORKER, out, timeout=560)
    errors = {f: (out / f).read_text() for f in os.listdir(out) if f.endswith(".error")}

    def load(name):
        assert not any(f.startswith(name + ".") for f in errors), errors
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in (0, 1)]

    return load


def _identical_fp8_state(r0, r1):
    assert r0["fp8"].keys() == r1["fp8"].keys() and r0["fp8"]
    for key in r0["fp8"]:  # histories (hence scales), overflow and clip counters, precision switches
        assert torch.equal(r0["fp8"][key], r1["fp8"][key]), key


def test_lightning_tensor_parallel_trains_and_every_rank_takes_a_skip_and_a_rollback(runs):
    r0, r1 = runs("lightning_tp")
    for r in (r0, r1):
        assert r["skips"] == SKIPS and r["rollbacks"] == ROLLBACKS  # injected on one rank, taken by both
        assert r["fc1"] == "FP8Linear" and r["fc1_weight"] == "DTensor(Shard(dim=0),)"
        assert r["meta_buffer"] == "Tensor"  # the FP8 metadata stays local (torch's styles would make it a DTensor)
    _identical_fp8_state(r0, r1)
    assert r0["loss_scale"] < 2.0**8  # the dynamic loss scale backed off on every rank (the default starts at 2^8)
    assert r0["loss_scale"] == r1["loss_scale"] and torch.equal(r0["weights"], r1["weights"])
    assert "colwise (FP8ColwiseParallel, FP8 all-gather of the sequence-parallel input): blocks.0.mlp.fc1" in r0["summary"]
    assert "rowwise (FP8RowwiseParallel): blocks.0.attn.proj (FP8)" in r0["summary"]
    assert "inputs all-gathered by PrepareFP8ModuleInput" in r0["summary"]


def test_a_plain_torch_plan_trains_and_matches_the_fp8_styles_bit_for_bit(runs):
    """torch's ColwiseParallel / RowwiseParallel / PrepareModuleInput in configure_model, on the layers the plugin
    converted before it: it trains, the summary names torch's styles, and it computes exactly what lightning_fp8's
    styles compute (they move FP8 bytes, not other values)."""
    plain, fp8 = runs("lightning_tp_torch_styles"), runs("lightning_tp")
    for r in plain:
        assert r["skips"] == SKIPS and r["rollbacks"] == ROLLBACKS and r["fc1"] == "FP8Linear"
    _identical_fp8_state(*plain)
    torch.testing.assert_close(torch.tensor(plain[0]["losses"]), torch.tensor(fp8[0]["losses"]), rtol=0, atol=0,
                               equal_nan=True)
    assert torch.equal(plain[0]["weights"], fp8[0]["weights"])
    assert "colwise (ColwiseParallel, high-precision communication): blocks.0.attn.q (BF16)" in plain[0]["summary"]
    assert "rowwise (RowwiseParallel, high-precision communication)" in plain[0]["summary"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_tp_loss_curve_equals_one_rank_within_the_stated_tolerance(runs, dtype):
    r0, r1 = runs("tp_vs_single")
    single, tp = torch.tensor(r0[dtype]["single"]), torch.tensor(r0[dtype]["tp"])
    assert torch.equal(tp, torch.tensor(r1[dtype]["tp"]))
    torch.testing.assert_close(tp, single, rtol=TP_VS_SINGLE_RTOL[dtype], atol=0)
    assert r0[dtype]["skips"] == [] and r0[dtype]["rollbacks"] == []
    _identical_fp8_state(r0[dtype], r1[dtype])


def test_fp8_sequence_gather_computes_what_torch_gather_computes_on_every_path(runs):
    for r in runs("sp_paths"):
        for path in ("train_0", "train_1", "train_2", "histories", "eval", "fp8_autocast_disabled", "recipe_override",
                     "fallback_layer", "calibration"):
            assert r[path] is True, path


def test_gathered_slices_are_brought_to_the_whole_tensors_scale(runs):
    for r in runs("gather_scales"):
        p2, exact = r["p2_True"], r["p2_False"]
        for case in (p2, exact):
            assert case["scale"] and case["amax"]  # the whole tensor's scale and amax, on every rank
        # power-of-two scales: rank 0's slice, shifted by a power of two, equals the direct cast except where it
        # lands in FP8's subnormals (re-rounded: one subnormal step, 2^-9, at most)
        assert p2["differ"] <= p2["numel"] // 100 and p2["subnormal_only"] and p2["max_abs_step"] <= 2**-9
        # other scales: rank 0's slice rounds twice, within one FP8 step (2^-3 of its binade)
        assert 0 < exact["differ"] and exact["max_rel_step"] <= 2**-3


def test_sequence_parallel_all_gather_moves_at_most_055_of_bf16_bytes(runs):
    for r in runs("sp_bytes"):
        # one block's forward: the attention input's and the MLP input's all-gathers, FP8 (with each rank's 8 bytes
        # of scale and amax) against BF16 activations
        assert r["gather_fp8"] / r["gather_bf16"] <= 0.55
        assert set(r["block_fp8"]) == {("_allgather_base_", "uint8"), ("reduce_scatter_tensor", "float32")}
        # a training step with gradient_communication="bf16": FP8 moves only in the sequence-parallel all-gathers;
        # the reduce-scatters (the row-wise outputs' forward, the gathered inputs' gradients) stay float32
        step = r["step_bf16"]
        assert [key for key in step if key[1] == "uint8"] == [("_allgather_base_", "uint8")]
        assert ("_reduce_scatter_base_", "float32") in step and ("reduce_scatter_tensor", "float32") in step
        # gradient_communication="fp8": the reduce-scatters become FP8 all-to-alls (+ their 4-byte scale all-reduce)
        fp8 = r["step_fp8"]
        assert ("alltoall_base_", "uint8") in fp8 and not any("reduce_scatter" in op for op, _ in fp8)
        grads = torch.cat([g.reshape(-1) for g in r["grads_fp8"]])
        reference = torch.cat([g.reshape(-1) for g in r["grads_bf16"]])
        assert float((grads - reference).norm() / reference.norm()) <= 2**-3  # two E4M3 roundings at most


def test_layers_not_casting_per_tensor_in_fp8_communicate_in_high_precision_and_the_summary_says_so(runs):
    for r in runs("comm_follows_compute"):
        # row-wise layers in BF16 under gradient_communication="fp8": their output reduce-scatters stay high
        # precision (no FP8 all-to-all); the column-wise layers, still FP8, gather their inputs in FP8
        fallback = r["fallback"]
        assert ("alltoall_base_", "uint8") not in fallback["table"], fallback["table"]
        assert ("reduce_scatter_tensor", "float32") in fallback["table"]
        assert ("_allgather_base_", "uint8") in fallback["table"]
        assert ("rowwise (FP8RowwiseParallel, high-precision communication): blocks.0.attn.proj (BF16), "
                "blocks.0.mlp.fc2 (BF16)") in fallback["summary"]
        # a fine-grained recipe casts per tile: nothing moves in FP8, and the summary does not claim it does
        finegrained = r["finegrained"]
        assert not any(dtype == "uint8" for _, dtype in finegrained["table"]), finegrained["table"]
        assert "FP8 all-gather" not in finegrained["summary"] and "FP8 reduce-scatter" not in finegrained["summary"]
        assert ("colwise (FP8ColwiseParallel, high-precision communication): blocks.0.mlp.fc1 (FP8)"
                in finegrained["summary"]), finegrained["summary"]


def test_plans_that_cannot_be_right_are_refused_with_what_to_use(runs):
    for r in runs("tp_errors"):
        assert "Only FP8 layers parallelized with FP8ColwiseParallel may read it" in r["torch_reader"]


def test_torch_styles_split_converted_layers_as_lightning_fp8s_styles_do(runs):
    """torch's RowwiseParallel / ColwiseParallel / PrepareModuleInput on FP8 layers (the plugins convert before the
    user's parallelize code): bit for bit what lightning_fp8's styles compute, and a Fabric parallelize function
    written with torch's styles trains."""
    for r in runs("torch_styles_on_fp8_layers"):
        assert r["train_0"] and r["train_1"] and r["train_2"]
        assert "rowwise (RowwiseParallel, high-precision communication)" in r["summary"]
        losses = torch.tensor(r["fabric_losses"])
        assert len(losses) == 3 and torch.isfinite(losses).all()


def test_fabric_adopts_the_styles_at_the_first_forward_and_reports_them(runs):
    r0, r1 = runs("fabric_tp")
    assert r0["steps"] == 4 and r0["reduce_precisions"] == ["fp8"]  # the plugin's gradient_communication reached them
    assert "after the parallelize function" in r0["logged"] and "FP8 reduce-scatter of the output" in r0["logged"]
    _identical_fp8_state(r0, r1)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (r0, r1))


def test_accelerate_parallelism_config_tensor_parallel(runs):
    r0, r1 = runs("accelerate_tp")
    assert r0["steps"] == 4 and r0["losses"] == r1["losses"]
    _identical_fp8_state(r0, r1)
