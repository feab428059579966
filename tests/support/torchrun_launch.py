"""Launching a multi-process test worker the way torchrun does, without port races, orphans or repeated imports.

A worker script calls `launch_forked(main, nproc)` under `if __name__ == "__main__"`: torchrun's own launcher
(`torch.distributed.launcher.api.elastic_launch`, what `torchrun --standalone` runs) starts `nproc` ranks with the
environment torchrun gives them (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT, TORCHELASTIC_RUN_ID: Lightning, Fabric
and Accelerate see a torchrun launch). Two choices differ from a plain torchrun command line, on purpose:
- the rendezvous binds port 0 itself (`--standalone`'s localhost:0): picking a free port here (bind port 0, close,
  pass the number) leaves a window in which another process may take it, and the launch then fails now and then;
- the ranks are forked from the launching process after it imported the worker's modules (lightning, accelerate,
  lightning_fp8): each fresh interpreter would import them again (about 8 s of CPU per rank on this machine, most of
  a launch). Forking is safe here because nothing has started a thread pool yet (OMP_NUM_THREADS=1, no CUDA).
A script already started by torchrun (`python -m torch.distributed.run ... worker.py`) runs `main` directly.

`run_workers` runs such a script from a test in its own session: a launch that outlives its timeout (a rank stuck in a
collective) is ended with every rank it started, not just the launching process.
"""
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable


def launch_forked(main: Callable[[], None], nproc: int) -> None:
    """Run `main` on `nproc` ranks (see the module docstring); raises if a rank fails, as torchrun exits non-zero."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one rank
        main()
        return
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="fork")
    elastic_launch(config, main)()


def run_workers(worker: str, out: Path, timeout: float, *scenarios: str) -> subprocess.CompletedProcess:
    """Run `worker OUT [scenario ...]`; fail the test (after killing the whole process group) if it is not done
    within `timeout` seconds."""
    import pytest

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    command = [sys.executable, worker, str(out), *scenarios]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{os.path.basename(worker)} did not finish within {timeout} s (killed):\n{stderr[-3000:]}")
    except BaseException:  # the test itself interrupted (pytest-timeout, Ctrl-C): no rank outlives it
        _kill_group(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session's group: the launcher and every rank it started
    except ProcessLookupError:
        pass
