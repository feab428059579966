"""Launching a multi-process test worker under torchrun without races and without orphans.

`--standalone` lets torchrun's own rendezvous bind port 0 and hand the port it got to the workers: picking a free port
here (bind port 0, close, pass the number) leaves a window in which another process may take it, and the launch then
fails now and then. The launch runs in its own session, so a launch that outlives its timeout (a rank stuck in a
collective) is ended with every worker it started, not just the torchrun process.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_workers(worker: str, nproc: int, out: Path, timeout: float, *scenarios: str) -> subprocess.CompletedProcess:
    """Run `worker OUT [scenario ...]` on `nproc` CPU ranks; fail the test (after killing the whole process group)
    if it is not done within `timeout` seconds."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), worker,
               str(out), *scenarios]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{os.path.basename(worker)} did not finish within {timeout} s (killed):\n{stderr[-3000:]}")
    except BaseException:  # the test itself interrupted (pytest-timeout, Ctrl-C): no worker outlives it
        _kill_group(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session's group: torchrun and every worker it started
    except ProcessLookupError:
        pass
