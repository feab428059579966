"""FSDP2 and FP8 communication on 2 CPU ranks (gloo): tests/workers/distributed_worker.py runs every scenario in one
launch (imports dominate a launch), these tests read what each rank wrote.

Parity with DDP: with 2 ranks every gradient reduction adds two float32 numbers, which is exact whatever the order,
so FSDP2 and DDP runs of the same model and data agree to the bit unless an op's own summation order differs
(the gradient norm of clipping, computed per shard then combined); the tolerance allows that: 1e-5 relative on the
losses of 8 steps (measured: 0, identical).

LIGHTNING_FP8_WORKER_PYTHON=/path/to/python runs the worker with another interpreter (another torch version: the
checks were run on torch 2.13 and 2.11).
"""
import os
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "workers", "distributed_worker.py")
#: losses of the FSDP2 runs vs the DDP runs (see the module docstring)
DDP_PARITY_RTOL = 1e-5
#: the faults the worker injects: rank 0's loss NaN at global step 1 (engine step 2: a skip and a rollback to the
#: state before step 1), rank 1's gradients inf at global step 3 (engine step 4: a skip, its overflow counted)
SKIPS, ROLLBACKS = [2, 4], [2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [os.environ.get("LIGHTNING_FP8_WORKER_PYTHON", sys.executable), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
         WORKER, str(out)], env=env, capture_output=True, text=True, timeout=560,
    )
    errors = {f: (out / f).read_text() for f in os.listdir(out) if f.endswith(".error")}

    def load(name):
        assert not any(f.startswith(name + ".") for f in errors), errors
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in (0, 1)]

    return load


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_on_both_ranks(r0, r1):
    assert r0["skips"] == r1["skips"] == SKIPS
    assert r0["rollbacks"] == r1["rollbacks"] == ROLLBACKS
    assert r0["loss_scale"] == r1["loss_scale"]
    assert r0["fp8"].keys() == r1["fp8"].keys() and r0["fp8"]
    for key in r0["fp8"]:  # histories (hence scales), overflow and clip counters, precision switches
        assert torch.equal(r0["fp8"][key], r1["fp8"][key]), key
    assert torch.equal(r0["weights"], r1["weights"])
    assert any(k.endswith("overflow_count") and r0["fp8"][k].sum() > 0 for k in r0["fp8"])  # the faults counted


def _resumed_bit_identical(r):
    assert r["resumed_losses"] == r["losses"][-len(r["resumed_losses"]):]
    assert torch.equal(r["resumed_weights"], r["weights"])
    for key in r["fp8"]:
        assert torch.equal(r["resumed"]["fp8"][key], r["fp8"][key]), key
    assert r["resumed"]["loss_scale"] == r["loss_scale"]


def _matches(a, b):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=DDP_PARITY_RTOL, atol=0,
                               equal_nan=True)


def test_lightning_model_parallel_identical_ranks_resume_and_ddp_parity(runs):
    fsdp, ddp = runs("lightning_fsdp2"), runs("lightning_ddp")
    _same_on_both_ranks(*fsdp)
    _same_on_both_ranks(*ddp)
    assert fsdp[0]["local_is_fp8_ag"] == "FP8AllGatherWeight"  # FP8 all-gather is on by default
    assert fsdp[0]["ckpt_is_dir"]  # a distributed checkpoint (one file per rank's shards)
    for r in fsdp:
        _resumed_bit_identical(r)
    _matches(fsdp[0], ddp[0])


def test_a_meta_built_sharded_model_resumes_from_a_distributed_checkpoint(runs):
    """Built on the meta device (trainer.init_module(empty_init=True)), materialized after fully_shard: every FP8
    state starts fresh (not to_empty's memory), the faults are handled alike on both ranks, and a fresh meta-built
    model resumed from the distributed checkpoint continues bit-identically."""
    r0, r1 = runs("lightning_fsdp2_meta_init")
    _same_on_both_ranks(r0, r1)
    for r in (r0, r1):
        assert r["built_on_meta"]
        start = r["fp8_at_start"]
        assert start and all(not v.any() for k, v in start.items() if k.endswith(("amax_history", "_count")))
        assert all(bool(v) for k, v in start.items() if k.endswith("enabled"))
        _resumed_bit_identical(r)


def test_experts_under_fsdp2_and_ddp_keep_identical_fp8_state_on_every_rank(runs):
    """A tiny Mixtral's experts (grouped FP8 GEMMs) under FSDP2 and DDP, each rank on its own batches: the experts'
    FP8 histories are identical on both ranks (the engine's amax all-reduce covers them), and FSDP2 computes what
    DDP computes (2 ranks: the reductions add two float32 numbers, exact)."""
    for name in ("moe_fsdp2", "moe_ddp"):
        r0, r1 = runs(name)
        assert len(r0["experts"]) == 4 and r0["experts"] == r1["experts"]
        assert r0["losses"] != r1["losses"]  # the ranks trained on different batches
        keys = [key for key in r0["fp8"] if ".experts." in key]
        assert keys and all(torch.equal(r0["fp8"][key], r1["fp8"][key]) for key in r0["fp8"])
        assert all(r0["fp8"][key][:, 1:].gt(0).any() for key in keys if key.endswith("amax_history"))
        assert torch.equal(r0["weights"], r1["weights"])
    fsdp, ddp = runs("moe_fsdp2")[0], runs("moe_ddp")[0]
    _matches(fsdp, ddp)
    for key in fsdp["fp8"]:
        assert torch.equal(fsdp["fp8"][key], ddp["fp8"][key]), key


def test_lightning_fp8_optimizer_on_sharded_parameters_resumes_bit_identically(runs):
    r0, r1 = runs("lightning_fsdp2_fp8_optimizer")
    _same_on_both_ranks(r0, r1)
    assert r0["optimizer"] == "FP8AdamW"
    assert r0["state_types"] == {"step": "Tensor", "exp_avg": "DTensor", "exp_avg_scale_inv": "DTensor",
                                 "exp_avg_sq": "DTensor", "exp_avg_sq_scale_inv": "DTensor"}
    assert r0["exp_avg_dtype"] == "torch.float8_e4m3fn"
    for r in (r0, r1):
        _resumed_bit_identical(r)


def test_fabric_model_parallel_identical_ranks_resume_and_ddp_parity(runs):
    fsdp, ddp = runs("fabric_fsdp2"), runs("fabric_ddp")
    _same_on_both_ranks(*fsdp)
    _same_on_both_ranks(*ddp)
    for r in fsdp:
        assert r["plugin_restored"]  # load_checkpoint put the plugin back and loaded it (fabric.load alone does not)
        _resumed_bit_identical(r)
    _matches(fsdp[0], ddp[0])


def test_accelerate_fsdp2_identical_ranks_resume_and_ddp_parity(runs):
    fsdp, ddp = runs("accelerate_fsdp2"), runs("accelerate_ddp")
    assert fsdp[0]["is_fsdp2"] and not ddp[0]["is_fsdp2"]
    assert fsdp[0]["fp8_all_gather"] == "FP8AllGatherWeight"
    _same_on_both_ranks(*fsdp)
    _same_on_both_ranks(*ddp)
    for r in fsdp + ddp:
        _resumed_bit_identical(r)
    _matches(fsdp[0], ddp[0])


def test_fp8_gradient_communication_through_the_plugins(runs):
    ddp, fsdp = runs("lightning_ddp_fp8_comm"), runs("lightning_fsdp2_fp8_comm")
    assert ddp[0]["registered"] and ddp[1]["registered"]  # the comm hook, registered by FP8Precision.connect
    assert fsdp[0]["comm"] == "FP8ReduceScatter"
    # rank 1's inf gradients reach rank 0 through the FP8 reduction: the same skips, the same state everywhere
    _same_on_both_ranks(*ddp)
    _same_on_both_ranks(*fsdp)


def test_fp8_gradient_communication_through_fabric(runs):
    for r in runs("fabric_fp8_comm"):
        assert "setup_gradient_communication" in r["ddp"]["missing_call_error"]
        assert r["ddp"]["fp8_comm"] and r["fsdp2"]["fp8_comm"]
    for kind in ("ddp", "fsdp2"):
        r0, r1 = (r[kind] for r in runs("fabric_fp8_comm"))
        _same_on_both_ranks(r0, r1)
        _resumed_bit_identical(r0)


def _relative_error(grads, reference):
    a = torch.cat([g.reshape(-1) for g in grads])
    b = torch.cat([g.reshape(-1) for g in reference])
    return float((a - b).norm() / b.norm())


def test_ddp_comm_hook_accuracy_bytes_and_nonfinite(runs):
    r0, r1 = runs("ddp_hooks")
    # round-to-nearest relative error per element: <= 2^-4 in E4M3 (one rounding), <= 2^-3 in E5M2 or with the
    # all-to-all variant's second rounding; norm-wise the same bounds hold
    bounds = {"fp8": 2**-4, "fp8_all_to_all": 2**-3, "fp8_e5m2_per_bucket": 2**-3}
    for name, bound in bounds.items():
        assert _relative_error(r0[name]["grads"], r0["fp32"]["grads"]) <= bound, name
        assert all(torch.equal(a, b) for a, b in zip(r0[name]["grads"], r1[name]["grads"]))  # every rank the same
        ratio = r0[name]["bus_bytes"] / r0["bf16"]["bus_bytes"]  # amax all-reduces included
        assert ratio <= 0.55, (name, ratio)
    assert ("_allgather_base_", "uint8") in r0["fp8"]["table"]
    # rank 1's inf gradient: every rank's gradient is non-finite afterwards (the engine then skips everywhere)
    assert not r0["finite_fc1"] and not r1["finite_fc1"]


def test_fsdp2_fp8_reduce_scatter_accuracy_bytes_and_nonfinite(runs):
    r0, r1 = runs("fsdp2_reduce_scatter")
    assert r0["units"] == 3  # two blocks and the root
    assert _relative_error(r0["fp8"]["grads"], r0["fp32"]["grads"]) <= 2**-4
    assert r0["fp8"]["reduce_bytes"] / r0["bf16"]["reduce_bytes"] <= 0.55
    for r in (r0, r1):
        assert not r["block1_finite_local"] and not r["block0_finite_local"]


def test_fp8_all_gather_moves_at_most_055_of_bf16_bytes(runs):
    r0, r1 = runs("all_gather_bytes")
    assert all(reason is None for reason in r0["decisions"].values()) and len(r0["decisions"]) == 31
    for r in (r0, r1):
        assert r["fp8"]["gather_bytes"] / r["bf16"]["gather_bytes"] <= 0.55  # the amax all-reduces included
        assert ("_allgather_base_", "uint8") in r["fp8"]["table"]


def test_fp8_all_gather_every_weight_path_exact(runs):
    for r in runs("all_gather_paths"):
        for path in ("train_fp8", "history", "eval_fp8", "fp8_autocast_disabled", "recipe_override",
                     "fallback_layer", "calibration", "calibration_amax"):
            assert r[path] is True, path
        assert "all-gathered in FP8" in r["foreign_read"]
        assert "shared with another module" in r["tied_reason"] == r["tied_reason_attr"]
        assert "convert_for_fsdp" in r["late_conversion"]


def test_fp8_all_gather_without_an_engine_casts_with_the_closed_history(runs):
    """Layers that close their own scaling steps (no engine): the pre-all-gather cast of the weight closes the pending
    step first, as the layer's forward does; before, it used the history of the step before, so the sharded model's
    weight scale (and every output from step 2 on) differed from the unsharded model's."""
    for r in runs("all_gather_lazy_scales"):
        assert r["same"] == [True, True, True, True]


def test_fp8_all_gather_agrees_every_weight_amax_in_one_all_reduce_per_iteration(runs):
    """The weight amaxes of all FP8-all-gather layers in one MAX all-reduce per iteration, whatever the layer count
    (2 or 4): after the optimizer step (precompute_fp8_weight_amaxes, what the engine's close does; the forward then
    needs none) or, without that call, at the forward's first gather. Before: one all-reduce per layer per forward.
    Bit for bit the unsharded model's outputs, gradients, histories and weights, also when the weights are written
    after the agreement (iteration 2 of "write": the forward agrees again instead of using the stale amax)."""
    for r in runs("all_gather_amax_collectives"):
        for layers in (2, 4):
            precomputed, lazy, written = (r[(layers, mode)] for mode in ("precompute", "lazy", "write"))
            assert precomputed["per_iteration"] == [2, 1, 1, 1]  # iteration 0's forward ran before any precompute
            assert lazy["per_iteration"] == [1, 1, 1, 1]
            assert written["per_iteration"] == [2, 1, 2, 1]
            for run in (precomputed, lazy, written):
                assert run["same"] == [True] * 4
        assert r["sizes"] == [2, 4]  # each all-reduce carries every layer's amax
