"""The examples run (at toy size): the Lightning project with callbacks and report, LightningCLI with its YAML,
Fabric and the unchanged Accelerate script (as each launched process runs it) in this process; the unchanged
transformers Trainer script through `python -m lightning_fp8.accelerate launch --mixed_precision fp8` on 2 CPU
processes. (FSDP2 under ModelParallelStrategy, 2 processes: tests/test_fsdp2_pattern.py.)"""
import os
import re
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run_here(monkeypatch, script, *args):
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")


def test_lightning_project_with_callbacks_and_report(monkeypatch, capsys, tmp_path):
    _run_here(monkeypatch, "lightning_project.py", "--steps", "4", "--max-chars", "40000", "--batch-size", "4",
              "--context", "16", "--out", str(tmp_path))
    out = capsys.readouterr().out
    assert re.search(r"model\.blocks\.1\.fc1 +fp8 +converted", out) and re.search(r"final val loss \d", out)
    report = re.search(r"report: (\S+)", out).group(1)
    assert os.path.exists(report) and os.path.exists(os.path.join(os.path.dirname(report), "metrics.csv"))


def test_lightning_cli_with_yaml(monkeypatch, capsys):
    _run_here(monkeypatch, "lightning_cli.py", "fit", "--config", os.path.join(EXAMPLES, "lightning_cli.yaml"),
              "--data.steps", "3", "--data.max_chars", "40000", "--data.batch_size", "4", "--data.context", "16",
              "--trainer.plugins.loss_scaling=1024")
    assert re.search(r"final val loss \d\.\d+, loss scale 1024, 0 skipped steps", capsys.readouterr().out)


def test_fabric_loop(monkeypatch, capsys, tmp_path):
    _run_here(monkeypatch, "fabric_train.py", "--steps", "4", "--max-chars", "40000", "--batch-size", "4", "--context",
              "16", "--save", str(tmp_path / "c.pt"))
    assert re.search(r"final val loss \d\.\d+, 0 skipped steps, 0 rollbacks, loss dtype torch.float32",
                     capsys.readouterr().out)
    assert os.path.exists(tmp_path / "c.pt")


def _launch_two_processes(script_args, tmp_path):
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--multi_gpu", "--num_processes", "2",
           "--num_cpu_threads_per_process", "1", "--main_process_port", str(_free_port()), "--mixed_precision",
           "fp8", *script_args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unchanged_accelerate_script_as_each_launched_process_runs_it(monkeypatch, capsys, tmp_path,
                                                                      fresh_accelerate_state):
    """A script that builds accelerate.Accelerator() and never imports lightning_fp8, run the way every process of
    `python -m lightning_fp8.accelerate launch --mixed_precision fp8` runs it (`_run_fp8`): it trains in FP8 (before:
    refused, pointing to FP8Accelerator) and save_state carries the FP8 state."""
    from lightning_fp8.integrations.accelerate import launcher, plain

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # what the launcher sets
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        launcher.main(["_run_fp8", "--script", os.path.join(EXAMPLES, "accelerate_unchanged.py"), "--steps", "4",
                     "--max-chars", "20000", "--batch-size", "4", "--block-size", "32",
                     "--output-dir", str(tmp_path / "state")])
    finally:
        plain.uninstall()
    assert re.search(r"mixed_precision=fp8 accelerator=FP8Accelerator steps=4 eval_loss=\d", capsys.readouterr().out)
    assert os.path.exists(tmp_path / "state" / "custom_checkpoint_0.pkl")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unchanged_hf_trainer_script_on_two_processes(tmp_path):
    """transformers' Trainer builds its own Accelerator: under the launcher it is an FP8Accelerator, and its
    checkpoints carry the FP8 state (scaler.pt)."""
    out = _launch_two_processes([os.path.join(EXAMPLES, "hf_trainer.py"), "--output_dir", str(tmp_path / "out"),
                                 "--max_steps", "6", "--save_steps", "6", "--max_chars", "20000", "--block_size", "32",
                                 "--report_to", "none", "--disable_tqdm", "true", "--per_device_train_batch_size", "4",
                                 "--per_device_eval_batch_size", "16"], tmp_path)
    assert "lightning_fp8: 6 of 9 linear layers run in FP8" in out
    assert re.search(r"mixed_precision=fp8 accelerator=FP8Accelerator steps=6 eval_loss=\d", out)
    assert os.path.exists(tmp_path / "out" / "checkpoint-6" / "scaler.pt")
