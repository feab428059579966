"""Lightning's and Fabric's own tensor-parallel example, as a user runs it with the FP8 plugin added (CPU settings
only), and the model-built-inside-configure_model form, on gloo ranks: tests/workers/lightning_examples_worker.py
runs every scenario of one rank count in one launch (2 ranks: three scenarios; 4 ranks: the 2 x 2 example).

Each run reads the same batch at every step (the example's random tokens are learnable only by memorizing them), so
the loss must fall; the first / last rule keeps layer 0's wq / wk / wv (one input) and the head in BF16, so 11 of the
15 linear layers are FP8 layers computing in FP8."""
import os

import pytest
import torch
from support.torchrun_launch import run_workers

WORKER = os.path.join(os.path.dirname(__file__), "workers", "lightning_examples_worker.py")
#: the example's 2 blocks x 7 linear layers + the head, less layer 0's wq / wk / wv and the head (first / last)
FP8_LAYERS = 11
KEPT_IN_BF16 = ("layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv", "output")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _launch(tmp_path_factory, nproc: int):
    out = tmp_path_factory.mktemp(f"lightning_examples_{nproc}")
    proc = run_workers(WORKER, out, 560, str(nproc))
    errors = {f: (out / f).read_text() for f in os.listdir(out) if f.endswith(".error")}

    def load(name):
        assert not any(f.startswith(name + ".") for f in errors), errors
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(nproc)]

    return load


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4)


def _short(fqn: str) -> str:
    """A layer's name in the example's Transformer (without the LightningModule's `model.`, Fabric's wrapper and the
    activation-checkpointing wrapper)."""
    for prefix in ("model.", "_forward_module."):
        fqn = fqn[len(prefix):] if fqn.startswith(prefix) else fqn
    return fqn.replace("_checkpoint_wrapped_module.", "")


def _trains_in_fp8(results, all_gather: bool):
    first = results[0]
    for r in results:
        losses = torch.tensor(r["losses"])
        assert len(losses) == 6 and torch.isfinite(losses).all(), r["losses"]
        assert (losses[1:] < losses[:-1]).all(), r["losses"]  # the same batch at every step: falls at every step
        assert r["steps"] == 6 and r["skips"] == 0
        # FP8 layers present and computing in FP8 (every role's history holds the amaxes of real casts)
        assert len(r["computing_in_fp8"]) == FP8_LAYERS, r["computing_in_fp8"]
        kept = sorted(_short(fqn) for fqn, (precision, _) in r["precision"].items() if precision == "bf16")
        assert kept == sorted(KEPT_IN_BF16), kept
        if all_gather:  # every layer computing in FP8 all-gathers its weight in FP8 under FSDP2
            assert r["fp8_all_gather"] == r["computing_in_fp8"]
        assert not [w for w in r["warnings"] if "high precision" in w], r["warnings"]
        assert r["summaries"] == 1  # one conversion summary per run
        # every rank holds the same weights (full tensors) and the same FP8 metadata
        assert torch.equal(r["weights"], first["weights"])
        for key in first["fp8"]:
            assert torch.equal(r["fp8"][key], first["fp8"][key]), key


def test_lightning_tp_example_with_loss_parallel_trains_in_fp8(two_ranks):
    """ModelParallelStrategy(tensor_parallel_size=2): the example's torch styles on FP8 layers, its loss a DTensor
    (loss_parallel), which the engine records and checks (before: `aten.cat.default got mixed torch.Tensor and
    DTensor` at the first step)."""
    results = two_ranks("lightning_tp_loss_parallel")
    _trains_in_fp8(results, all_gather=False)
    assert results[0]["loss_types"] == ["DTensor"]
    assert results[0]["losses"] == results[1]["losses"]  # one tensor-parallel group: one loss


def test_lightning_2d_example_with_plain_torch_styles_trains_in_fp8_with_one_summary(four_ranks):
    """The example as shipped (FSDP2 x TP, 2 x 2: torch's ColwiseParallel / RowwiseParallel / SequenceParallel, then
    activation checkpointing and fully_shard with a BF16 MixedPrecisionPolicy): FP8 layers under both, their weights
    all-gathered in FP8, and the conversion summary once (before: refused, "already sharded ... not converted")."""
    results = four_ranks("lightning_2d_example")
    _trains_in_fp8(results, all_gather=True)
    assert results[0]["loss_types"] == ["DTensor"]
    assert results[0]["losses"] == results[1]["losses"] and results[2]["losses"] == results[3]["losses"]


def test_a_model_built_inside_configure_model_trains_with_fp8_all_gather(two_ranks):
    """The large-model form (`if self.model is not None: return`, build, fully_shard; no lightning_fp8 line): its
    linear layers are built as FP8 layers with FP8 all-gather weights; the first / last rule, decided after sharding
    in module order, keeps four in BF16, and those gather their weights in high precision only."""
    results = two_ranks("lightning_built_in_configure_model")
    _trains_in_fp8(results, all_gather=True)
    r = results[0]
    assert len(r["fp8_layers"]) == 15  # every linear layer was built as an FP8 layer; four compute in BF16
    for fqn in KEPT_IN_BF16:
        precision, reason = r["precision"][f"model.{fqn}"]
        assert precision == "bf16"
        assert "module order, a guess: the layers were built and sharded inside configure_model" in reason
        assert r["gather_reasons"][f"model.{fqn}"] == "computes in BF16: kept there by the conversion rules"
    assert r["output_weight"] == ["Parameter"]  # the BF16 head's gathered weight: high precision, not FP8 bytes


def test_fabric_example_layout_gives_no_false_high_precision_gather_warning(two_ranks):
    """Fabric's example over 2 data-parallel ranks: the last block (reshard_after_forward=False) holds its weights
    unsharded at the first backward, where the plugin checks the all-gather; it asks the layers, not those weights
    (before: "7 FP8 layers gather their weights in high precision ... convert with precision.convert_for_fsdp")."""
    results = two_ranks("fabric_fsdp_example_layout")
    assert len(results[0]["unsharded_at_backward"]) == 7  # the state the check meets: the last block's 7 layers
    _trains_in_fp8(results, all_gather=True)
