"""DDP with 2 CPU processes (gloo): synced amaxes give identical scales and identical weights on both ranks, and the
engine's reductions leave nothing with gloo's worker threads (a run ends with exit code 0)."""
import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_two_ranks_identical_weights_and_scales(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "workers", "ddp_train.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]  # rank 1 (not the launched process) aborted
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


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="makes gloo's worker threads late through Linux's scheduler")
def test_engine_reductions_leave_nothing_with_gloo_workers_at_exit(tmp_path):
    """Gloo drops a finished collective on its worker thread; a buffer Python created, dropped there while the
    interpreter finalizes, aborts the process ("terminate called without an active exception", exit code -6). Each
    rank of tests/workers/gloo_exit_probe.py makes the worker threads late on purpose and exits without ending its
    process group: every buffer all_reduce_max_ reduced must be freed when it returns, and both ranks must exit with 0.
    Without the wait in lightning_fp8/engine/distributed.py, 0 to 5 of the 20 buffers were freed on return (every
    rank, 10 runs) and 14 of the 20 processes aborted."""
    script = os.path.join(os.path.dirname(__file__), "workers", "gloo_exit_probe.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    calls = 20
    procs = [
        subprocess.Popen([sys.executable, script, str(rank), str(tmp_path / "store"), str(calls)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=110) for proc in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert "terminate called" not in err, f"rank {rank}: {err[-3000:]}"
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}: {err[-3000:]}"
        assert out.split() == ["released", f"{calls}/{calls}"], f"rank {rank}: {out}"


# -- the release wait, in one process ------------------------------------------------------------------------------
def test_the_release_wait_follows_cpp_ownership_of_the_buffer():
    """What all_reduce_max_ relies on: torch counts a C++ owner of a tensor in the reference count of its Python
    object, so the wait ends exactly when the last C++ owner (gloo's worker thread, in a real run) lets go."""
    import threading
    import time

    from lightning_fp8.engine.distributed import run_and_wait_for_release

    held = []

    def collective_kept_by_cpp(buffer):  # a torch.futures.Future holds its result in C++
        future = torch.futures.Future()
        future.set_result(buffer)
        held.append(future)

    buffer = torch.zeros(3)
    assert not run_and_wait_for_release(buffer, collective_kept_by_cpp, timeout_s=0.05)  # still held: times out
    threading.Timer(0.05, held.clear).start()  # a thread lets go a moment later
    start = time.monotonic()
    assert run_and_wait_for_release(buffer, collective_kept_by_cpp, timeout_s=5.0)
    assert 0.04 < time.monotonic() - start < 4.0
    assert run_and_wait_for_release(buffer, lambda b: b.add_(1), timeout_s=0.0)  # nothing kept: no wait at all


def test_a_backend_that_keeps_every_buffer_is_waited_for_once(monkeypatch):
    """A backend that never lets go would cost RELEASE_TIMEOUT_S per reduction: all_reduce_max_ warns once, then
    stops waiting, and its results stay right."""
    import warnings

    from lightning_fp8.engine import distributed

    kept = []

    def all_reduce_that_keeps(tensor, op=None):
        future = torch.futures.Future()
        future.set_result(tensor)
        kept.append(future)

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce_that_keeps)
    monkeypatch.setattr(distributed, "RELEASE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(distributed._release_wait, "enabled", True)
    waits = []
    wait = distributed.run_and_wait_for_release
    monkeypatch.setattr(distributed, "run_and_wait_for_release", lambda *a, **k: waits.append(wait(*a, **k)) or waits[-1])
    flags = torch.tensor([0.0, 1.0])
    with pytest.warns(RuntimeWarning, match="destroy_process_group"):
        distributed.all_reduce_max_([flags])
    assert waits == [False] and flags.tolist() == [0.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        distributed.all_reduce_max_([flags])
    assert waits == [False] and len(kept) == 2 and flags.tolist() == [0.0, 1.0]  # reduced, without a second wait
