"""Exit codes of 2-rank Lightning DDP runs on CPU (gloo): FP8Precision vs precision="bf16-mixed".

A 3-linear model, 10 optimizer steps, strategy="ddp", devices=2 (Lightning's own launcher: the launched process is
rank 0 and starts rank 1 itself). Every run's exit code is collected for *both* ranks: this process becomes a child
subreaper (Linux prctl), so rank 1, which Lightning leaves orphaned, is reaped here too. Also counted: "terminate
called" in the runs' stderr (docs/plugin.md, "DDP on CPU (gloo): the end of a run").

    python benchmarks/ddp_exit.py --runs 20 [--late-workers] [--end-group] [--out benchmarks/results/ddp_exit]

--late-workers makes gloo's worker threads late on purpose, the way tests/workers/gloo_exit_probe.py does (every thread of a
rank on one CPU, the workers in SCHED_IDLE, a 1 ms GIL hold in the last exit handler): what a busy machine does now
and then, every time. --end-group ends each run with a barrier and destroy_process_group.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

VARIANTS = ("fp8", "bf16-mixed")
PR_SET_CHILD_SUBREAPER = 36


def train(variant: str, late_workers: bool, end_group: bool) -> None:
    """One 2-rank fit (Lightning runs this function in both ranks)."""
    import atexit
    import warnings

    if late_workers:  # registered first, so it runs last, right before the interpreter finalizes
        atexit.register(ctypes.PyDLL(None).usleep, 1000)
    warnings.simplefilter("ignore")
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class ThreeLinears(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class LateGlooWorkers(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            cpus = sorted(os.sched_getaffinity(0))
            for tid in map(int, os.listdir("/proc/self/task")):
                os.sched_setaffinity(tid, {cpus[trainer.global_rank % len(cpus)]})
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "pt_gloo_runloop":
                        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))

    torch.manual_seed(0)
    x = torch.randn(512, 32)
    data = DataLoader(TensorDataset(x, x @ torch.randn(32, 32)), batch_size=16)
    if variant == "fp8":
        from lightning_fp8 import FP8Precision

        precision = {"plugins": [FP8Precision()]}
    else:
        precision = {"precision": variant}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[LateGlooWorkers()] if late_workers else [], **precision)
    trainer.fit(ThreeLinears(), data)
    if end_group:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_many(variant: str, runs: int, late_workers: bool, end_group: bool) -> dict:
    """`runs` fits; per rank, how many ended with each exit code; runs with a 'terminate called' message."""
    codes = collections.Counter()
    terminate_runs = 0
    start = time.monotonic()
    for i in range(runs):
        cmd = [sys.executable, os.path.abspath(__file__), "--train", variant]
        cmd += ["--late-workers"] if late_workers else []
        cmd += ["--end-group"] if end_group else []
        with tempfile.TemporaryFile() as err:
            launched = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            ended = []
            while True:  # the launched process (rank 0) and, as their subreaper, every process it left behind
                try:
                    pid, status = os.waitpid(-1, 0)
                except ChildProcessError:
                    break
                ended.append(("rank0" if pid == launched.pid else "rank1", os.waitstatus_to_exitcode(status)))
            err.seek(0)
            terminated = b"terminate called" in err.read()
        codes.update(f"{rank}: {code}" for rank, code in ended)
        terminate_runs += terminated
        print(f"{variant} run {i + 1}/{runs}: {sorted(ended)}{'  terminate called' if terminated else ''}", flush=True)
    return {"exit_codes": dict(sorted(codes.items())), "runs_with_terminate_called": terminate_runs,
            "seconds": round(time.monotonic() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--late-workers", action="store_true")
    parser.add_argument("--end-group", action="store_true")
    parser.add_argument("--out", default=None, help="write OUT.json")
    parser.add_argument("--train", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        return train(args.train, args.late_workers, args.end_group)
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("needs Linux: prctl(PR_SET_CHILD_SUBREAPER) failed")
    results = {variant: run_many(variant, args.runs, args.late_workers, args.end_group) for variant in args.variants}
    record = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "runs": args.runs, "late_workers": args.late_workers, "end_group": args.end_group, "results": results}
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
