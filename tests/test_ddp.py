"""DDP with 2 CPU processes (gloo): synced amaxes give identical scales and identical weights on both ranks."""
import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_two_ranks_identical_weights_and_scales(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "ddp_train.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert not torch.equal(r0.pop("raw_amax_rank"), r1.pop("raw_amax_rank"))  # ranks saw different data
    # an overflow on rank 0 alone is skipped on both ranks, once (DDP must not broadcast the FP8 counters)
    assert r0["skipped_steps"].item() == r1["skipped_steps"].item() == 1
    assert r0["skip_steps"].tolist() == r1["skip_steps"].tolist() == [6]
    histories = [k for k in r0 if k.endswith("fp8_meta.amax_history")]
    assert histories
    for key in r0:  # counters included: the step-close collective carries the overflow / clip flags
        assert torch.equal(r0[key], r1[key]), key
    # the synced histories (they size the delayed scales) hold real amaxes of every role
    assert all((r0[k][:, 1] > 0).all() for k in histories)
