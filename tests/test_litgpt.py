"""litgpt in FP8 without an edit of litgpt: `python -m lightning_fp8.litgpt COMMAND ... --precision fp8`
(lightning_fp8/integrations/litgpt_fabrics.py), run on a tiny config and local data: pretrain, its resume, finetune_lora with
its merge step, and the command line itself.

litgpt's commands run in this process (`main(argv)` returns the plugins their Fabrics carried) with torch.compile
turned off, which litgpt's pretrain applies to every model (seconds instead of minutes on a CPU); the `slow` test runs
the real command in a subprocess, compile included."""
import copy
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("litgpt")

import lightning as L  # noqa: E402
from lightning.fabric.plugins.precision import HalfPrecision  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy  # noqa: E402
from litgpt import Config  # noqa: E402
from litgpt.lora import GPT as LoRAGPT  # noqa: E402
from litgpt.lora import lora_filter, merge_lora_weights  # noqa: E402
from litgpt.model import GPT  # noqa: E402

from lightning_fp8 import precision_map  # noqa: E402
from lightning_fp8.conversion.convert import fp8_layers  # noqa: E402
from lightning_fp8.fabric import FP8Precision  # noqa: E402
from lightning_fp8.integrations import litgpt_fabrics as fp8_litgpt  # noqa: E402
from lightning_fp8.litgpt import fp8_fabrics, main  # noqa: E402
from support.helpers import mlp  # noqa: E402
from support.litgpt_data import make_checkpoint_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: a tiny litgpt model: 2 blocks, every GEMM dimension a multiple of 16 (FP8 GEMMs need it)
TINY = dict(name="tiny-fp8", n_layer=2, n_head=4, n_embd=64, bias=True)
PRETRAIN_ITERS = 10
FINETUNE_STEPS = 4


# -- the command line --------------------------------------------------------------------------------------------
def test_fp8_precision_is_taken_and_litgpt_gets_a_precision_it_knows():
    command = fp8_litgpt.parse_command_line(["pretrain", "m", "--precision", "fp8", "--train.max_tokens", "8"],
                                            environ={})
    assert command.litgpt_argv == ["pretrain", "m", "--precision", "bf16-mixed", "--train.max_tokens", "8"]
    assert command.fp8_argv == [] and command.plugins.compute_dtype == torch.bfloat16

    command = fp8_litgpt.parse_command_line(["finetune_lora", "ck", "--precision=fp8-mixed", "--fp8.compute_dtype",
                                             "fp16", "--fp8.recipe.scaling=current"], environ={})
    assert command.litgpt_argv == ["finetune_lora", "ck", "--precision=16-mixed"]
    assert command.fp8_argv == ["--fp8.compute_dtype", "fp16", "--fp8.recipe.scaling=current"]
    plugin = command.plugins()
    assert isinstance(plugin, FP8Precision) and plugin.recipe.scaling == "current"
    assert plugin.compute_dtype == torch.float16
    assert command.plugins() is not plugin  # a new plugin for each Fabric

    # without --precision fp8 the command line is litgpt's, untouched
    plain = ["pretrain", "m", "--precision", "bf16-true"]
    assert fp8_litgpt.parse_command_line(plain, environ={}) == fp8_litgpt.LitGPTCommand(plain)


@pytest.mark.parametrize("argv, message", [
    (["pretrain", "--fp8.loss_scaling", "dynamic"], "add --precision fp8|pass --precision fp8"),
    (["pretrain", "--precision", "fp8", "--precision", "bf16-true"], "pass --precision fp8 once"),
    (["pretrain", "--precision", "fp8", "--fp8.loss_scaling", "bogus"], "valid choices: ['auto', 'dynamic', 'none']"),
    (["pretrain", "--precision", "fp8", "--fp8.no_such_option", "1"], "--fp8.help lists the options"),
    (["pretrain", "--precision", "fp8", "--fp8.recipe.scaling", "sideways"], "scaling"),
    (["pretrain", "--precision", "fp8", "--fp8.loss_scaling"], "needs a value"),
])
def test_bad_fp8_options_stop_before_litgpt_runs_with_a_message_naming_the_fix(argv, message):
    with pytest.raises(SystemExit) as raised:
        fp8_litgpt.parse_command_line(argv, environ={})
    assert any(part in str(raised.value) for part in message.split("|")), str(raised.value)


def test_fp8_help_lists_the_plugin_options(capsys):
    with pytest.raises(SystemExit) as raised:
        fp8_litgpt.parse_command_line(["pretrain", "--fp8.help"], environ={})
    assert raised.value.code == 0
    out = capsys.readouterr().out
    for option in ("--fp8.recipe", "--fp8.loss_scaling", "--fp8.compute_dtype", "--fp8.fp8_eval"):
        assert option in out


def test_processes_litgpt_launches_inherit_fp8_through_the_environment():
    """A process Lightning's launcher starts re-runs the command line litgpt parsed (no --precision fp8 left in it):
    the options set by the launching process make it an FP8 run with the same plugin options."""
    launched = ["pretrain", "m", "--precision", "bf16-mixed"]
    environ = {fp8_litgpt.ENV_OPTIONS: json.dumps(["--fp8.loss_scaling", "dynamic"])}
    command = fp8_litgpt.parse_command_line(launched, environ=environ)
    assert command.litgpt_argv == launched
    assert command.plugins().options.loss_scaling == "dynamic"
    assert fp8_litgpt.parse_command_line(launched, environ={}).plugins is None


def test_every_fabric_built_inside_carries_a_new_plugin_and_none_after():
    originals = {name: getattr(L.Fabric, name) for name in ("__init__", "save", "load", "clip_gradients")}
    with fp8_fabrics(FP8Precision) as plugins:
        first = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")  # the string is dropped
        second = L.Fabric(accelerator="cpu", devices=1)
        assert [first.strategy.precision, second.strategy.precision] == plugins
        assert plugins[0] is not plugins[1] and all(isinstance(p, FP8Precision) for p in plugins)
        with pytest.raises(ValueError, match="cannot run with the precision plugin HalfPrecision"):
            L.Fabric(accelerator="cpu", devices=1, plugins=[HalfPrecision()])
        with pytest.raises(ValueError, match=r"FSDPStrategy \(FSDP1\).*--devices 1"):
            L.Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy())
    after = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    assert not isinstance(after.strategy.precision, FP8Precision)
    assert {name: getattr(L.Fabric, name) for name in originals} == originals


def test_a_nonfinite_gradient_norm_skips_the_step_instead_of_ending_the_run():
    """litgpt's pretrain calls `fabric.clip_gradients(model, optimizer, max_norm=...)`, whose default raises on a
    non-finite norm: under FP8 the plugin's engine skips that step instead; an explicit True still raises."""
    with fp8_fabrics(FP8Precision) as plugins:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
        model, optimizer = fabric.setup(*_model_and_optimizer())
        before = [p.detach().clone() for p in model.parameters()]
        fabric.backward(model(torch.randn(8, 32)).float().square().mean())
        next(model.parameters()).grad.view(-1)[0] = float("inf")
        assert not torch.isfinite(fabric.clip_gradients(model, optimizer, max_norm=1.0))
        with pytest.raises(RuntimeError, match="non-finite"):
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=True)
        optimizer.step()
    assert plugins[0].skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    plain = L.Fabric(accelerator="cpu", devices=1)  # outside: Fabric's own default again
    model, optimizer = plain.setup(*_model_and_optimizer())
    plain.backward(model(torch.randn(8, 32)).square().mean())
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        plain.clip_gradients(model, optimizer, max_norm=1.0)


def _model_and_optimizer():
    model = mlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# -- running litgpt's commands -----------------------------------------------------------------------------------
def run_litgpt(argv):
    """`python -m lightning_fp8.litgpt *argv` in this process, with torch.compile off and the process-wide settings
    litgpt and Fabric change (float32 matmul precision, the seed variable) restored afterwards."""
    matmul_precision, environ = torch.get_float32_matmul_precision(), dict(os.environ)
    try:
        with torch._dynamo.config.patch(disable=True):
            return main([str(arg) for arg in argv])
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        os.environ.clear()
        os.environ.update(environ)


def logged(out_dir, column):
    """The finite values of a column of the run's CSV log (litgpt's `--logger_name csv`)."""
    rows = list(csv.DictReader(open(next(Path(out_dir).glob("logs/csv/version_*/metrics.csv")))))
    return [float(row[column]) for row in rows if row.get(column)]


def assert_trained_in_fp8(plugin, steps):
    """The plugin's model has its linear layers in FP8 (at most a first and a last kept in BF16, by the default
    rules), each of them recorded amaxes in training (only an FP8 cast does), and every optimizer step went through
    the plugin's engine."""
    model = plugin._module
    rows = precision_map(model)
    fp8_rows = [row for row in rows if row.precision == "fp8"]
    assert len(fp8_rows) >= len(rows) - 2 >= 5, [(row.fqn, row.precision, row.reason) for row in rows]
    layers = fp8_layers(model)
    assert {row.fqn for row in fp8_rows} <= set(layers)
    for row in fp8_rows:
        history = layers[row.fqn].fp8_meta.amax_history
        assert torch.isfinite(history).all() and (history[0] > 0).any(), row.fqn  # input amaxes were recorded
    assert (plugin.engine.step_count, plugin.engine.skipped_steps) == (steps, 0)


def assert_gemms_in_fp8(plugin, input_ids):
    """One forward + backward of (a copy of) the plugin's model under the plugin's forward context, as a Fabric
    training step runs it, dispatches one FP8 GEMM per FP8 layer for the forward, one more where the layer's input
    needs a gradient and one more where its weight does; at least one FP8 GEMM per FP8 layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        gemms = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.lightning_fp8.fp8_gemm.default:
                Count.gemms += 1
            return func(*args, **(kwargs or {}))

    model = copy.deepcopy(plugin._module).train()
    layers = [layer for fqn, layer in fp8_layers(model).items() if layer.fp8_enabled]
    expected = []
    hooks = [layer.register_forward_pre_hook(
        lambda layer, args: expected.append(1 + args[0].requires_grad + layer.weight.requires_grad)) for layer in layers]
    with Count(), plugin.forward_context():
        model(input_ids).float().sum().backward()
    for hook in hooks:
        hook.remove()
    assert len(expected) == len(layers) >= 5
    assert Count.gemms == sum(expected)
    return expected


@pytest.fixture(scope="module")
def pretrain_setup(tmp_path_factory):
    """Local text (the first 60 kB of CPython's os.py, its bytes the tokens) and a tiny model config."""
    import sysconfig

    root = tmp_path_factory.mktemp("litgpt_pretrain")
    text = root / "text.txt"
    text.write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "os.py").read_bytes()[:60_000])
    config = root / "model_config.yaml"
    config.write_text("".join(f"{key}: {value}\n" for key, value in
                              dict(TINY, block_size=64, vocab_size=256, padded_vocab_size=256).items()))
    return root, text, config


def pretrain_argv(setup, out_dir, *extra):
    root, text, config = setup
    tokens = PRETRAIN_ITERS * 4 * 64  # iterations x micro batch x block size
    return ["pretrain", "tiny", "--model_config", config, "--data", "support.litgpt_data.LocalTextBytes",
            "--data.path", text, "--train.max_tokens", tokens, "--train.micro_batch_size", 4,
            "--train.global_batch_size", 4, "--train.lr_warmup_steps", 2, "--train.save_interval", 5,
            "--eval.interval", 5, "--eval.max_iters", 2, "--devices", 1, "--logger_name", "csv",
            "--out_dir", out_dir, "--precision", "fp8", *extra]


@pytest.fixture(scope="module")
def pretrained(pretrain_setup):
    out_dir = pretrain_setup[0] / "out"
    plugins = run_litgpt(pretrain_argv(pretrain_setup, out_dir))
    return out_dir, plugins


def test_pretrain_trains_in_fp8_and_writes_checkpoints_plain_litgpt_loads(pretrained):
    out_dir, plugins = pretrained
    assert len(plugins) == 1 and isinstance(plugins[0], FP8Precision)
    plugin = plugins[0]
    assert isinstance(plugin._module, GPT)
    assert_trained_in_fp8(plugin, PRETRAIN_ITERS)
    assert set(assert_gemms_in_fp8(plugin, torch.randint(0, 256, (2, 64)))) == {3}  # forward, dgrad, wgrad each

    losses, val_losses = logged(out_dir, "loss"), logged(out_dir, "val_loss")
    assert len(losses) == PRETRAIN_ITERS and len(val_losses) >= 2
    assert all(math.isfinite(value) for value in losses + val_losses)
    assert losses[-1] < losses[0]  # a learning rate warmed up over 2 of 10 steps: the byte statistics are learnt fast

    # litgpt's checkpoint: the model's weights under plain keys (a plain GPT loads them strictly), the FP8 state in
    # its own entry, and hyperparameters.yaml with a precision litgpt knows
    checkpoint = torch.load(out_dir / "final" / "lit_model.pth", weights_only=True)
    plain = GPT(Config.from_file(out_dir / "final" / "model_config.yaml"))
    plain.load_state_dict(checkpoint["model"], strict=True)
    trained = plugin._module.state_dict()
    assert checkpoint["model"].keys() == trained.keys()
    assert all(torch.equal(checkpoint["model"][key], trained[key]) for key in trained)
    fp8_state = checkpoint[fp8_litgpt.CHECKPOINT_KEY]
    for fqn, layer in fp8_layers(plugin._module).items():
        assert torch.equal(fp8_state["fp8_meta"][f"{fqn}.fp8_meta.amax_history"], layer.fp8_meta.amax_history)
    assert "precision: bf16-mixed" in (out_dir / "final" / "hyperparameters.yaml").read_text()


def test_litgpt_resume_continues_the_fp8_scaling_state_bit_identically(pretrained, pretrain_setup, tmp_path):
    """litgpt's `--resume` from step 5 ends where the uninterrupted run ended, bit for bit: the checkpoint carries
    the plugin's state (FP8 scales, amax histories, loss scaler) and the data loader's position. The same checkpoint
    without the plugin's entry resumes with the scaling restarted, and ends elsewhere."""
    out_dir, _ = pretrained
    uninterrupted = torch.load(out_dir / "final" / "lit_model.pth", weights_only=True)["model"]
    step5 = out_dir / "step-00000005" / "lit_model.pth"
    assert fp8_litgpt.CHECKPOINT_KEY in torch.load(step5, weights_only=True)

    resumed = tmp_path / "resumed"
    run_litgpt(pretrain_argv(pretrain_setup, resumed, "--resume", step5))
    final = torch.load(resumed / "final" / "lit_model.pth", weights_only=True)["model"]
    assert all(torch.equal(final[key], uninterrupted[key]) for key in uninterrupted)
    assert logged(resumed, "loss") == logged(out_dir, "loss")[5:]

    without_fp8_state = tmp_path / "step5_without_fp8_state.pth"
    checkpoint = torch.load(step5, weights_only=True)
    del checkpoint[fp8_litgpt.CHECKPOINT_KEY]
    torch.save(checkpoint, without_fp8_state)
    restarted = tmp_path / "restarted"
    run_litgpt(pretrain_argv(pretrain_setup, restarted, "--resume", without_fp8_state))
    final = torch.load(restarted / "final" / "lit_model.pth", weights_only=True)["model"]
    assert not all(torch.equal(final[key], uninterrupted[key]) for key in uninterrupted)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """finetune_lora in FP8 from a tiny base checkpoint (random weights, a byte tokenizer) on local JSON data."""
    root = tmp_path_factory.mktemp("litgpt_finetune")
    config = Config(block_size=256, vocab_size=258, padded_vocab_size=272, **TINY)
    base = make_checkpoint_dir(root / "base", config)
    data = root / "sft.json"
    data.write_text(json.dumps([{"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)}
                                for a in range(6) for b in range(4)]))
    out_dir = root / "out"
    plugins = run_litgpt([
        "finetune_lora", base, "--data", "JSON", "--data.json_path", data, "--data.val_split_fraction", 0.25,
        "--data.num_workers", 0, "--train.epochs", 1, "--train.max_steps", FINETUNE_STEPS,
        "--train.global_batch_size", 2, "--train.micro_batch_size", 2, "--train.lr_warmup_steps", 1,
        "--train.save_interval", 1000, "--eval.interval", 1000, "--eval.max_new_tokens", 5, "--eval.max_iters", 2,
        "--devices", 1, "--logger_name", "csv", "--out_dir", out_dir, "--precision", "fp8"])
    return base, out_dir, plugins


def test_finetune_lora_trains_the_frozen_base_layers_in_fp8(finetuned):
    base, out_dir, plugins = finetuned
    assert len(plugins) == 2 and all(isinstance(p, FP8Precision) for p in plugins)  # finetune's Fabric, merge's
    plugin = plugins[0]
    model = plugin._module
    assert isinstance(model, LoRAGPT)
    assert_trained_in_fp8(plugin, FINETUNE_STEPS)
    # the LoRA layers' base linears are FP8 layers, frozen: forward and input-gradient GEMMs, no weight gradient
    qkv = model.transformer.h[1].attn.qkv
    assert qkv.linear in fp8_layers(model).values() and not qkv.linear.weight.requires_grad
    assert qkv.lora_A.requires_grad and qkv.lora_B.abs().sum() > 0  # the adapter trained (B starts at zero)
    assert set(assert_gemms_in_fp8(plugin, torch.randint(0, 258, (2, 32)))) <= {1, 2}
    losses = logged(out_dir, "loss")
    assert len(losses) == FINETUNE_STEPS and all(math.isfinite(value) for value in losses)
    assert math.isfinite(logged(out_dir, "val_loss")[-1])


def test_the_merge_step_writes_litgpts_merge_of_the_fp8_model_which_a_plain_gpt_loads(finetuned):
    """finetune_lora ends with litgpt's merge_lora, whose Fabric carries the plugin too (its model is built on the
    meta device inside `fabric.init_module()` and loaded with `assign=True`): the merged lit_model.pth loads strictly
    into a plain litgpt GPT and equals, bit for bit, litgpt's merge of the trained FP8 model's weights."""
    base, out_dir, plugins = finetuned
    final = out_dir / "final"
    merged = torch.load(final / "lit_model.pth", weights_only=True)
    config = Config.from_file(final / "model_config.yaml")
    plain = GPT(config)
    plain.load_state_dict(merged, strict=True)

    reference = copy.deepcopy(plugins[0]._module)
    merge_lora_weights(reference)
    expected = {key.replace("linear.", ""): value for key, value in reference.state_dict().items()
                if not lora_filter(key, value)}
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[key], expected[key]) for key in expected)
    base_weights = torch.load(base / "lit_model.pth", weights_only=True)
    assert not torch.equal(merged["transformer.h.1.attn.qkv.weight"], base_weights["transformer.h.1.attn.qkv.weight"])
    assert torch.equal(merged["transformer.h.1.mlp.fc.weight"], base_weights["transformer.h.1.mlp.fc.weight"])

    with torch.no_grad():
        logits = plain(torch.randint(0, 258, (1, 32)))
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_the_command_as_users_run_it_pretrains_in_fp8_with_torch_compile(pretrain_setup, tmp_path):
    """`python -m lightning_fp8.litgpt pretrain ... --precision fp8` in a subprocess, as litgpt runs it:
    torch.compile on, the conversion summary logged, a finite loss, a checkpoint with the FP8 state."""
    out_dir = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "lightning_fp8.litgpt",
                             *map(str, pretrain_argv(pretrain_setup, out_dir))],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "runs with FP8Precision" in output and "linear layers run in FP8" in output
    losses = logged(out_dir, "loss")
    assert len(losses) == PRETRAIN_ITERS and all(math.isfinite(value) for value in losses)
    checkpoint = torch.load(out_dir / "final" / "lit_model.pth", weights_only=True)
    assert checkpoint[fp8_litgpt.CHECKPOINT_KEY]["fp8_meta"]


def test_without_litgpt_the_entry_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "litgpt.__main__", None)  # what `import` meets where litgpt is not installed
    with pytest.raises(SystemExit, match="pip install --no-deps litgpt"):
        main(["pretrain", "--precision", "fp8"])


def test_without_requests_litgpts_cli_runs_with_url_config_files_off(monkeypatch, capsys):
    """litgpt's CLI turns URL config files on (twice: at start and when it saves hyperparameters.yaml), which
    jsonargparse refuses without `requests` (no longer installed with huggingface_hub >= 1)."""
    import importlib.util

    import jsonargparse
    import litgpt.__main__ as litgpt_cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "requests" else find_spec(name, *a))
    original = jsonargparse.set_config_read_mode
    with fp8_litgpt._config_files_readable(litgpt_cli):
        litgpt_cli.set_config_read_mode(urls_enabled=True)
        jsonargparse.set_config_read_mode(urls_enabled=True)
    assert jsonargparse.set_config_read_mode is original and litgpt_cli.set_config_read_mode is original
    assert capsys.readouterr().err.count("`requests` is not installed") == 1
