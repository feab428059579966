"""Run by tests/test_ddp.py: 2-process DDP (gloo, CPU) training under FP8Precision.

Each rank trains on its own shard (DistributedSampler), so activations and gradients, and therefore raw amaxes,
differ between ranks. Each rank saves its final state; the test checks the ranks agree exactly.
"""
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
from support.helpers import RegressionModule, regression_data, trainer  # noqa: E402
from support.process_group import process_group_ended  # noqa: E402

from lightning_fp8 import FP8Precision, fp8_state_dict  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def main(out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = RegressionModule()
    plugin = FP8Precision(loss_scaling="dynamic")

    def overflow_on_rank0(mod, inputs, output):
        # one activation overflow, on rank 0 only, at step 5: every rank must skip exactly that one step
        if model.trainer.global_rank == 0 and model.trainer.global_step == 5:
            return output * float("inf")
        return output

    model.net[1].register_forward_hook(overflow_on_rank0)
    t = trainer(plugins=[plugin], strategy="ddp", devices=2, max_epochs=2)
    t.fit(model, DataLoader(regression_data(256), batch_size=16, shuffle=False))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.update({k: v.detach().clone() for k, v in fp8_state_dict(model).items()})
    state["loss_scale"] = torch.tensor(plugin.loss_scale)
    state["skipped_steps"] = torch.tensor(plugin.skipped_steps)
    state["skip_steps"] = torch.tensor([e["step"] for e in plugin.engine.events if e["kind"] == "skip"])
    state["raw_amax_rank"] = torch.tensor(model.losses)  # per-rank losses differ: proof the shards differ
    torch.save(state, f"{out_dir}/rank{t.global_rank}.pt")


if __name__ == "__main__":
    with process_group_ended():
        main(sys.argv[1])
