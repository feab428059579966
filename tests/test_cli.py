"""The console script: help, unknown command, a tiny demo run (the README's demo at toy size)."""
import pytest

from lightning_fp8.cli import main


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "valid commands: demo, report" in capsys.readouterr().err


def test_demo_runs_and_prints_the_table(capsys):
    args = ["--steps", "4", "--d-model", "32", "--layers", "2", "--heads", "2", "--batch-size", "4", "--context", "16", "--val-batches", "1"]
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert "relative val-loss gap" in out
    assert "model.blocks.1.fc1   fp8   delayed    converted" in out  # the table shows each FP8 layer's scaling
    assert "first linear layer kept in BF16" in out


def test_demo_recipe_choice(capsys):
    args = ["--steps", "2", "--d-model", "32", "--layers", "2", "--heads", "2", "--batch-size", "4", "--context", "16",
            "--val-batches", "1", "--recipe", "blockwise"]
    assert main(["demo", *args]) == 0
    assert "model.blocks.1.fc1   fp8   blockwise  converted" in capsys.readouterr().out
    assert main(["demo", *args[:-1], "nvfp4"]) == 0  # the Blackwell recipes: 2 blocks keep no NVFP4 tail block
    assert "model.blocks.1.fc1   fp8   nvfp4      converted" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--recipe", "tilewise"])
    assert "invalid choice: 'tilewise'" in capsys.readouterr().err


def test_demo_times_are_labelled_and_the_baseline_is_what_the_cpu_runs_best(capsys, monkeypatch):
    """On a CPU without BF16 hardware (AVX2 only) torch's BF16 is a software fallback: the demo's baseline runs in
    float32 there and says why, and the emulated FP8 time is labelled (before: "bf16 166 s vs fp8 45 s")."""
    from lightning_fp8.demo import run

    monkeypatch.setattr(run, "bf16_in_hardware", lambda device: False)
    args = ["--steps", "2", "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "4", "--context", "16",
            "--val-batches", "1"]
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert "\nfp32 " in out and "fp8 (emulated)" in out and "\nbf16 " not in out
    assert "baseline fp32: this cpu has no BF16 hardware" in out
    assert "the fp8 time measures the emulation, not FP8 speed" in out
    monkeypatch.setattr(run, "bf16_in_hardware", lambda device: True)
    assert run.choose_baseline("auto", "cpu")[0] == "bf16" and run.choose_baseline("fp32", "cuda")[0] == "fp32"


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_demo_recipe_with_the_mellempudi_preset_and_a_fine_grained_recipe(scaling):
    """--preset mellempudi casts gradients with scale 1, which the fine-grained scalings refuse: --recipe gives them
    scales (before: ValueError from FP8Recipe for every one of these)."""
    import argparse

    from lightning_fp8.demo.run import build_parser, demo_recipe

    args = build_parser(argparse.ArgumentParser()).parse_args(["--preset", "mellempudi", "--recipe", scaling])
    recipe = demo_recipe(args)
    assert recipe.scaling == scaling and recipe.scale_gradients
