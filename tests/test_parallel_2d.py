"""FSDP2 x tensor parallelism (2 x 2) on 4 CPU ranks (gloo): tests/workers/parallel_2d_worker.py runs both scenarios
in one launch (4 processes on this machine's 2 cores: the model is tiny and the runs short)."""
import os

import pytest
import torch
from support.torchrun_launch import run_workers

WORKER = os.path.join(os.path.dirname(__file__), "workers", "parallel_2d_worker.py")
RANKS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel_2d")
    proc = run_workers(WORKER, out, timeout=560)
    errors = {f: (out / f).read_text() for f in os.listdir(out) if f.endswith(".error")}

    def load(name):
        assert not any(f.startswith(name + ".") for f in errors), errors
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(RANKS)]

    return load


def _consistent_and_resumed(results):
    first = results[0]
    for r in results:
        for key in first["fp8"]:  # every rank (both TP groups, both FSDP2 shards) holds the same FP8 metadata
            assert torch.equal(r["fp8"][key], first["fp8"][key]), key
        assert torch.equal(r["weights"], first["weights"])
        # resumed from the distributed checkpoint: the same losses, weights and FP8 state as without the interruption
        assert r["resumed_losses"] == r["losses"][-len(r["resumed_losses"]):]  # (no NaN after the rollback)
        assert torch.equal(r["resumed_weights"], r["weights"])
        for key in r["fp8"]:
            assert torch.equal(r["resumed"]["fp8"][key], r["fp8"][key]), key
        assert r["resumed"]["loss_scale"] == r["loss_scale"]
    losses = [torch.tensor(r["losses"]) for r in results]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0, equal_nan=True)  # a tensor-parallel pair
    torch.testing.assert_close(losses[2], losses[3], rtol=0, atol=0, equal_nan=True)
    assert not torch.allclose(losses[0], losses[2], equal_nan=True)  # the data-parallel groups read other batches


def test_lightning_fsdp2_x_tp_takes_faults_on_every_rank_and_resumes_bit_identically(runs):
    results = runs("lightning_2d")
    _consistent_and_resumed(results)
    for r in results:
        # rank 0's NaN loss, rank 1's inf gradient, injected where no collective carries them to another rank
        assert r["skips"] == [2, 4] and r["rollbacks"] == [2] and r["loss_scale"] < 2.0**8
    assert results[0]["ckpt_is_dir"]  # a distributed checkpoint
    assert [r["summaries"] for r in results] == [1] * RANKS  # one conversion summary per run (was two)
    # the TP-sharded weight is sharded again by FSDP2 and all-gathered in FP8
    assert results[0]["fc1_placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert results[0]["fc1_local"] == "FP8AllGatherWeight"
    for r in results:
        # the weight amaxes of all FP8-all-gather layers in one all-reduce (over the data-parallel group): one at each
        # iteration's close (the engine's, after the step, for the next forward), plus the first forward's, which no
        # close preceded; was one per layer and forward
        assert r["fp8_all_gather_layers"] > 1
        assert set(r["amax_all_reduces"]) == {r["fp8_all_gather_layers"]}
        assert 0 < len(r["amax_all_reduces"]) <= len(r["losses"]) + 1


def test_fabric_fsdp2_x_tp_with_fp8_gradient_communication_resumes_bit_identically(runs):
    results = runs("fabric_2d")
    _consistent_and_resumed(results)
    assert results[0]["fsdp_comm"] == "FP8ReduceScatter"
