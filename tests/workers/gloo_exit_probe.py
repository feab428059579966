"""Run by tests/test_ddp.py on 2 CPU processes (gloo): the engine's reductions leave nothing with gloo's worker threads,
so a run ends with exit code 0 even when those threads are late.

    python tests/workers/gloo_exit_probe.py RANK STORE_FILE CALLS

Gloo runs each collective on a worker thread, which drops the finished work (and the reduced buffer with it) a moment
after the caller's wait() returned. Dropping a buffer that Python created takes the GIL; if the interpreter is
finalizing by then, the thread ends inside a C++ destructor and the process aborts ("terminate called without an
active exception", exit code -6). On a busy machine a worker is sometimes late enough for that; here it is late every
time: every thread of the process shares one CPU and the workers run in SCHED_IDLE, so the woken main thread preempts
a worker that just finished, and the worker runs again only when the main thread blocks. At exit a handler blocks the
main thread for 1 ms while it holds the GIL: a late worker runs then, waits for the GIL, and gets it as the
interpreter finalizes.

Each rank calls all_reduce_max_ CALLS times and checks after each that the buffer it reduced has been freed, prints
"released k/CALLS", and ends without destroy_process_group: the exit is what is tested.
"""
import atexit
import ctypes
import os
import sys
import time

# registered first, so it runs last, right before the interpreter finalizes; PyDLL keeps the GIL during the call
atexit.register(ctypes.PyDLL(None).usleep, 1000)

import weakref  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_fp8.engine.distributed import all_reduce_max_  # noqa: E402

GLOO_WORKER_THREAD = "pt_gloo_runloop"
GLOO_WORKERS = 2  # ProcessGroupGloo's default number of worker threads


def thread_names() -> dict:
    names = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names[tid] = f.read().strip()
    return names


def make_gloo_workers_late(cpu: int) -> None:
    """Every thread of this process on `cpu`, gloo's worker threads in SCHED_IDLE. A worker names itself when it first
    runs, which on a busy machine can be a while after init_process_group returned: wait for both names."""
    deadline = time.monotonic() + 60
    while sum(name == GLOO_WORKER_THREAD for name in thread_names().values()) < GLOO_WORKERS:
        assert time.monotonic() < deadline, f"no {GLOO_WORKERS} '{GLOO_WORKER_THREAD}' threads after 60 s: {thread_names()}"
        time.sleep(0.01)
    for tid, name in thread_names().items():
        os.sched_setaffinity(tid, {cpu})
        if name == GLOO_WORKER_THREAD:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def main(rank: int, store_file: str, calls: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    cpus = sorted(os.sched_getaffinity(0))
    make_gloo_workers_late(cpus[rank % len(cpus)])

    reduced = []
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced.append(weakref.ref(tensor))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    released = 0
    for step in range(calls):
        flags = torch.tensor([float(rank == step % 2), 0.0, float(step)])  # the shape of the engine's step flags
        all_reduce_max_([flags])
        assert flags.tolist() == [1.0, 0.0, float(step)], flags
        released += reduced[-1]() is None  # freed: no worker thread holds it any more
    print(f"released {released}/{calls}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
