"""A precision a library sets by default does not override the FP8 the user launched; one the user typed still wins
(docs/accelerate.md, "Which precision wins"; lightning_fp8/integrations/accelerate/precision_source.py).

- trl's `SFTConfig` turns bf16 on by default: its unchanged SFT script under the launcher trains in FP8 (every
  converted linear layer runs its FP8 GEMMs) and one line says why;
- `--bf16` typed on the command line (every form HfArgumentParser takes, an options file), `TrainingArguments(bf16=True)`
  in code, `Accelerator(mixed_precision="bf16")` in the script: the explicit precision wins, with a warning that names
  what the user did and how to undo it (never a flag they did not pass).
"""
import json
import os
import re
import subprocess
import sys
import warnings

import accelerate
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
from trl import SFTConfig, TrlParser

from support.helpers import DispatchCount
from lightning_fp8 import fp8_layers
from lightning_fp8.accelerate import enable_fp8
from lightning_fp8.integrations.accelerate import accelerator as accelerator_module
from lightning_fp8.integrations.accelerate import fp8_config, launcher, plain

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
#: what each trial run passes besides the option under test: one CPU process, no saving, no logging services
RUN_ARGS = ["--use_cpu", "true", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true"]
FP8_WINS = re.compile(r"lightning_fp8: trl's SFTConfig turns bf16 on by default \(field default None, resolved to True "
                      r"by the library; --bf16 is not on the command line\): the launch's FP8 wins over a library "
                      r"default, so this run trains in FP8 \(args\.bf16 set to False, args\.mixed_precision to 'fp8'\)\. "
                      r"To train in bf16, pass --bf16 true on the command line or launch with --mixed_precision bf16\.")


@pytest.fixture(autouse=True)
def fp8_launch(monkeypatch, fresh_accelerate_state):
    """Each process of `python -m lightning_fp8.accelerate launch --mixed_precision fp8` on CPU: FP8 requested in the
    environment, plain Accelerators made FP8 ones; every message may be said again. (fresh_accelerate_state:
    tests/conftest.py.)"""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(fp8_config, "_said", set())
    plain.install()
    yield
    plain.uninstall()


@pytest.fixture
def prepared_models(monkeypatch):
    """The models the FP8 Accelerators of the run prepare."""
    models = []
    prepare_model = accelerator_module.FP8AcceleratorMixin.prepare_model

    def recording(self, model, *args, **kwargs):
        models.append(model)
        return prepare_model(self, model, *args, **kwargs)

    monkeypatch.setattr(accelerator_module.FP8AcceleratorMixin, "prepare_model", recording)
    return models


def _run_script(script, *args):
    """The script as each process of the launcher runs it (`_run_fp8`), counting the FP8 GEMMs it dispatches."""
    with DispatchCount() as count:
        launcher.main(["_run_fp8", "--script", os.path.join(EXAMPLES, script), *args])
    return count.of("lightning_fp8.fp8_gemm")


def _said(caplog, pattern):
    return [r.getMessage() for r in caplog.records if r.name == "lightning_fp8" and re.search(pattern, r.getMessage())]


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def test_trl_sft_script_trains_in_fp8_under_the_launch_and_says_why(tmp_path, caplog, capsys, prepared_models):
    """trl's SFT script, unchanged: SFTConfig's bf16 default no longer beats `--mixed_precision fp8` (before: the run
    trained in BF16 and told the user to drop a --bf16 they never passed)."""
    caplog.set_level("INFO", logger="lightning_fp8")
    steps = 3
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        gemms = _run_script("trl_sft.py", "--output_dir", str(tmp_path), "--max_steps", str(steps),
                            "--num_samples", "32", *RUN_ARGS)
    assert re.search(rf"mixed_precision=fp8 accelerator=FP8Accelerator steps={steps} ", capsys.readouterr().out)
    assert len(_said(caplog, FP8_WINS.pattern)) == 1  # the one line
    assert not [w for w in warned if "NOT in FP8" in str(w.message)]
    (model,) = prepared_models
    layers = sorted(fp8_layers(model))
    # 15 linear layers: q, k, v of block 0 (the first, with the two reading its input) and lm_head (the last) in BF16
    assert len(layers) == 11 and "lm_head" not in layers and "model.layers.0.self_attn.q_proj" not in layers
    # every FP8 layer, every step: forward, its activation-checkpointing recompute (trl turns gradient_checkpointing on
    # by default), the input-gradient and the weight-gradient GEMM
    assert gemms == steps * len(layers) * 4


def test_bf16_typed_on_the_trl_command_line_wins_with_a_warning_naming_it(tmp_path, caplog, capsys, prepared_models):
    with pytest.warns(UserWarning, match=r"mixed_precision='bf16' explicitly \(transformers' Trainer passes it from "
                                         r"trl's SFTConfig: bf16=True, from `--bf16 true` on the command line\).* this "
                                         r"run trains in 'bf16', NOT in FP8\. Remove `--bf16 true` on the command line "
                                         r"to train in FP8\."):
        gemms = _run_script("trl_sft.py", "--output_dir", str(tmp_path), "--max_steps", "1", "--num_samples", "8",
                            "--bf16", "true", *RUN_ARGS)
    assert "mixed_precision=bf16 " in capsys.readouterr().out
    assert gemms == 0 and not fp8_layers(prepared_models[0]) and not _said(caplog, "FP8 wins")


def test_bf16_typed_for_transformers_trainer_wins_with_a_warning_naming_it(tmp_path, capsys):
    """examples/hf_trainer.py (HfArgumentParser, TrainingArguments) with `--bf16`: bf16, as before, and the warning."""
    with pytest.warns(UserWarning, match=r"TrainingArguments: bf16=True, from `--bf16` on the command line\).* this "
                                         r"run trains in 'bf16', NOT in FP8\. Remove `--bf16` on the command line"):
        gemms = _run_script("hf_trainer.py", "--output_dir", str(tmp_path), "--max_steps", "1", "--max_chars",
                            "4000", "--block_size", "16", "--bf16", *RUN_ARGS)
    assert "mixed_precision=bf16 " in capsys.readouterr().out and gemms == 0


@pytest.mark.parametrize("typed, named", [
    (["--bf16", "true"], "`--bf16 true` on the command line"),
    (["--bf16=True"], "`--bf16=True` on the command line"),
    (["--bf16", "1"], "`--bf16 1` on the command line"),
    (["sft.yaml"], "bf16 in {tmp}/sft.yaml"),  # TrlParser's options file: --config sft.yaml
    (["args.json"], "bf16 in {tmp}/args.json"),  # run_clm's `python train.py args.json`
    (["train.args"], "`--bf16 true` in train.args"),  # the .args file HfArgumentParser reads next to the script
])
def test_every_way_of_typing_bf16_for_trl_counts_as_the_users(tmp_path, typed, named):
    common = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
    if typed == ["args.json"]:
        (tmp_path / "args.json").write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True,
                                                        "report_to": "none", "bf16": True}))
        sys.argv[:] = ["train.py", str(tmp_path / "args.json")]
        (args,) = HfArgumentParser(SFTConfig).parse_json_file(sys.argv[1])
    else:
        if typed == ["sft.yaml"]:
            (tmp_path / "sft.yaml").write_text("bf16: true\n")
            sys.argv[:] = ["train.py", *common, "--config", str(tmp_path / "sft.yaml")]
        elif typed == ["train.args"]:
            (tmp_path / "train.args").write_text("--bf16 true\n")
            sys.argv[:] = [str(tmp_path / "train.py"), *common]
        else:
            sys.argv[:] = ["train.py", *common, *typed]
        (args,) = TrlParser(SFTConfig).parse_args_and_config()
    accelerator = Trainer(model=_gpt2(), args=args).accelerator
    assert accelerator.mixed_precision == "bf16" and args.bf16 is True and args.mixed_precision == "bf16"
    named = named.format(tmp=tmp_path)
    with pytest.warns(UserWarning, match=re.escape(f"trl's SFTConfig: bf16=True, from {named})") + ".* NOT in FP8. "
                                         + re.escape(f"Remove {named} to train in FP8.")):
        accelerator.prepare(torch.nn.Linear(16, 16))


def test_a_trl_default_loses_to_the_launch_and_the_arguments_say_so(tmp_path, caplog):
    """SFTConfig built in code without bf16: trl's default. FP8 wins and the arguments stop saying bf16 (trl's GRPO /
    RLOO trainers cast the model to bfloat16 for generation when `args.bf16` is True)."""
    caplog.set_level("INFO", logger="lightning_fp8")
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.bf16 is True and args.mixed_precision == "bf16"
    assert Trainer(model=_gpt2(), args=args).accelerator.mixed_precision == "fp8"
    assert args.bf16 is False and args.mixed_precision == "fp8"
    assert len(_said(caplog, FP8_WINS.pattern)) == 1


def test_bf16_set_in_code_where_the_field_defaults_to_false_wins(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=True, max_steps=1)
    trainer = Trainer(model=_gpt2(), args=args)
    assert trainer.accelerator.mixed_precision == "bf16"
    with pytest.warns(UserWarning, match=r"TrainingArguments: bf16=True, set in the script, whose field default is "
                                         r"False; --bf16 is not on the command line\).* NOT in FP8\. Set bf16=False in "
                                         r"the script's TrainingArguments to train in FP8\."):
        trainer.accelerator.prepare(torch.nn.Linear(16, 16))


def test_an_accelerator_built_with_bf16_in_the_script_wins():
    accelerator = accelerate.Accelerator(mixed_precision="bf16")
    assert accelerator.mixed_precision == "bf16" and accelerator.fp8_engine is None
    with pytest.warns(UserWarning, match=r"this Accelerator was built with mixed_precision='bf16' explicitly in the "
                                         r"script, and an explicit argument wins .* NOT in FP8\. Remove that argument "
                                         r"to train in FP8\."):
        accelerator.prepare(torch.nn.Linear(16, 16))


def test_arguments_built_before_enable_fp8_no_longer_hold_fp8_off(tmp_path, monkeypatch, caplog):
    """TrainingArguments read ACCELERATE_MIXED_PRECISION when built: before `enable_fp8()` they hold 'no', which no one
    chose (bf16 and fp16 are off), so the FP8 asked for wins."""
    caplog.set_level("INFO", logger="lightning_fp8")
    plain.uninstall()
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.mixed_precision == "no"
    enable_fp8()
    trainer = Trainer(model=_gpt2(), args=args)
    assert trainer.accelerator.mixed_precision == "fp8" and args.mixed_precision == "fp8"
    assert _said(caplog, r"transformers' TrainingArguments, built before FP8 was requested, read mixed_precision 'no' "
                         r"from ACCELERATE_MIXED_PRECISION then .*the launch's FP8 wins")


def test_any_library_that_defaults_a_precision_on_loses_to_the_launch(tmp_path, caplog):
    """Not only trl: a TrainingArguments subclass whose bf16 field defaults to True."""
    from dataclasses import dataclass, field

    @dataclass
    class LibraryConfig(TrainingArguments):
        bf16: bool = field(default=True)

    caplog.set_level("INFO", logger="lightning_fp8")
    args = LibraryConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert Trainer(model=_gpt2(), args=args).accelerator.mixed_precision == "fp8"
    assert _said(caplog, r"LibraryConfig turns bf16 on by default \(field default True; --bf16 is not on")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_sft_script_through_the_launcher_command(tmp_path):
    """The whole chain in a launched process: `python -m lightning_fp8.accelerate launch --mixed_precision fp8`, one
    process, trl's TrlParser reading the script's command line."""
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--num_processes", "1", "--num_machines", "1",
           "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", "--mixed_precision", "fp8",
           os.path.join(EXAMPLES, "trl_sft.py"), "--output_dir", str(tmp_path), "--max_steps", "2", "--num_samples",
           "16", *RUN_ARGS]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(FP8_WINS.findall(out)) == 1
    assert "lightning_fp8: 11 of 15 linear layers run in FP8" in out
    assert re.search(r"mixed_precision=fp8 accelerator=FP8Accelerator steps=2 ", out)
