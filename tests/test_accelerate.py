"""lightning_fp8.accelerate: FP8Accelerator on CPU (argument, env var, launcher, config file, 2 processes), skip and
rollback, clipping, gradient accumulation, save/load resume, FP8 optimizer state, non-FP8 behaviour, and loss parity
with the Lightning plugin.

(Length: the adapter's every Accelerate entry point, sharing one model, data and launch helpers.)
"""
import inspect
import json
import math
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import AutocastKwargs
from torch.utils.data import DataLoader, TensorDataset

from support.helpers import RegressionModule, full_state, loader, mlp, trainer
from lightning_fp8 import FP8Linear, FP8Precision, fp8_state_dict, precision_map
from lightning_fp8.accelerate import FP8Accelerator, FP8AcceleratedOptimizer, FP8Kwargs
from lightning_fp8.modules.autocast import current_state

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: on a busy 2-core machine, OpenMP threads waiting on each other cost 100x the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py


def _setup(seed=0, lr=1e-2, scheduler=False, **accelerator_kwargs):
    torch.manual_seed(seed)
    accelerator = FP8Accelerator(cpu=True, **accelerator_kwargs)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    objects = [model, optimizer]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)))
    return (accelerator, *accelerator.prepare(*objects))


def _train(accelerator, model, optimizer, batches, scheduler=None, clip=None, before_step=None, after_backward=None):
    losses, skipped = [], []
    for i, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        if before_step is not None:
            before_step(i)
        loss = F.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        if after_backward is not None:
            after_backward(i)
        if clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        skipped.append(optimizer.step_was_skipped)
    return losses, skipped


def _fp8_layers(model):
    """The layers computing in FP8 (the first and the last are FP8 layers switched off, decided at the first forward)."""
    return [m for m in model.modules() if isinstance(m, FP8Linear) and m.fp8_enabled]


# -- turning FP8 on -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["argument", "env"])
def test_fp8_converts_and_trains(source, monkeypatch):
    if source == "env":
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # what `accelerate launch` / config files set
        accelerator, model, optimizer = _setup()
    else:
        accelerator, model, optimizer = _setup(mixed_precision="fp8")
    assert accelerator.mixed_precision == "fp8" and accelerator.state.mixed_precision == "fp8"
    assert accelerator.fp8_engine is not None and isinstance(optimizer, FP8AcceleratedOptimizer)
    assert [row.precision for row in precision_map(model)] == ["bf16", "fp8", "fp8", "bf16"]
    seen = {}
    model[2].register_forward_hook(
        lambda m, i, o: seen.update(autocast=torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
                                    fp8=current_state().enabled, out=o.dtype)
    )
    losses, skipped = _train(accelerator, model, optimizer, list(loader()) * 2)
    assert seen == {"autocast": torch.bfloat16, "fp8": True, "out": torch.bfloat16}
    with accelerator.autocast():  # the same context for code outside the forward
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and current_state().enabled
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu") and not current_state().enabled
    assert model(torch.randn(2, 32)).dtype == torch.float32  # outputs upcast, as Accelerate's bf16 wrapper does
    assert losses[-1] < 0.8 * losses[0] and not any(skipped)
    assert accelerator.fp8_engine.step_count == 16
    assert all(layer.fp8_meta.input.initialized for layer in _fp8_layers(model))  # engine-updated delayed scales
    # unwrap_model(keep_fp32_wrapper=False) removes our forward wrapper, as it removes Accelerate's
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.randn(2, 32))
    assert seen["autocast"] is None and seen["out"] == torch.float32


def test_second_accelerator_shares_the_fp8_state():
    FP8Accelerator(cpu=True, mixed_precision="fp8")
    assert FP8Accelerator(cpu=True).mixed_precision == "fp8"  # AcceleratorState is a singleton, as in Accelerate
    with pytest.raises(ValueError, match="already been initialized with mixed_precision='fp8'"):
        FP8Accelerator(cpu=True, mixed_precision="bf16")


def test_state_reports_fp8_and_accelerate_takes_none_of_its_fp8_branches(caplog):
    """accelerator.state.mixed_precision is "fp8" (what Accelerate's run_me.py / nlp_example.py print), while
    Accelerate itself was set up with "no": no autocast, GradScaler or FP8 backend of its own, also for an Accelerator
    built after the state says "fp8" (Accelerate's __init__ would otherwise pick TE / torchao / MS-AMP or raise)."""
    from accelerate.utils import is_fp8_available
    from accelerate.utils.dataclasses import FP8BackendType

    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8")
    assert accelerator.state.mixed_precision == AcceleratorState().mixed_precision == "fp8"
    assert "Mixed precision type: fp8" in str(accelerator.state)
    second = FP8Accelerator(cpu=True)  # built on a state that says "fp8"
    for acc in (accelerator, second):
        assert acc.mixed_precision == acc.state.mixed_precision == "fp8" and acc.fp8_engine is not None
        assert not acc.native_amp and acc.fp8_backend == FP8BackendType.NO and not acc.delayed_fp8_autocast
        assert not acc.has_fp8_handler and acc.fp8_recipe_handler is None and acc.te_recipe_handler is None
        assert acc.ao_recipe_handler is None and acc.msamp_recipe_handler is None
        assert not isinstance(acc.scaler, torch.amp.GradScaler)
    model = second.prepare(mlp())
    seen = {}
    model[2].register_forward_hook(lambda m, i, o: seen.update(dtype=torch.get_autocast_dtype("cpu"),
                                                                fp8=current_state().enabled))
    assert model(torch.randn(2, 32)).dtype == torch.float32 and seen == {"dtype": torch.bfloat16, "fp8": True}
    if not is_fp8_available():
        # a plain accelerate.Accelerator built afterwards in the same process sees "fp8" and takes Accelerate's own
        # FP8 path, which needs one of its backends: it fails loudly (under the launcher, or after enable_fp8(), every
        # Accelerator of the process is an FP8Accelerator instead)
        with pytest.raises(ImportError, match="no FP8-compatible backend"):
            Accelerator(cpu=True)


# -- the launch's fp8_config (accelerate config files, --fp8_* flags) -------------------------------------------------
TEMPLATE = os.path.join(HERE, "data", "accelerate_fp8.yaml")  # Accelerate's own examples/config_yaml_templates/fp8.yaml
RUN_ME = os.path.join(HERE, "data", "accelerate_run_me.py")  # Accelerate's own examples/config_yaml_templates/run_me.py


@pytest.fixture
def fp8_config_env(monkeypatch):
    """No ACCELERATE_FP8_* variable from the environment, and every fp8_config message sayable again."""
    from lightning_fp8.integrations.accelerate import fp8_config

    for name in [k for k in os.environ if k.startswith("ACCELERATE_FP8_")]:
        monkeypatch.delenv(name)
    fp8_config._reset_said()
    yield monkeypatch
    fp8_config._reset_said()


def test_fp8_config_fields_that_map_are_honoured_and_the_rest_named_once(fp8_config_env, caplog):
    settings = {"FORMAT": "E4M3", "AMAX_HISTORY_LEN": "1024", "AMAX_COMPUTE_ALGO": "most_recent", "MARGIN": "1",
                "USE_AUTOCAST_DURING_EVAL": "False", "OVERRIDE_FPROP": "True", "OVERRIDE_DGRAD": "False",
                "OVERRIDE_WGRAD": "True", "ENABLE_FSDP_FLOAT8_ALL_GATHER": "0", "BACKEND": "TE", "INTERVAL": "2",
                "OPT_LEVEL": "O1", "PAD_INNER_DIM": "1"}
    for key, value in settings.items():
        fp8_config_env.setenv(f"ACCELERATE_FP8_{key}", value)
    with caplog.at_level("INFO", logger="lightning_fp8"), pytest.warns(UserWarning) as caught:
        accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8")
        FP8Accelerator(cpu=True)  # a second Accelerator of the process: nothing said twice
    recipe = accelerator.fp8_engine.recipe
    assert (recipe.format, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin, recipe.weight_grad) == (
        "e4m3", 1024, "most_recent", 1, "high_precision")
    assert recipe.scaling == "delayed" and recipe.keep_first_last_in_bf16  # the rest: the default recipe
    assert accelerator._fp8_core.fp8_eval is False and accelerator._fp8_core.options.fp8_all_gather is False
    ignored = [str(w.message) for w in caught if "no equivalent in lightning_fp8 are ignored" in str(w.message)]
    assert len(ignored) == 1
    for name in ("backend=TE", "interval=2", "override_linear_precision fprop=True", "opt_level=O1",
                 "pad_inner_dim=True"):
        assert name in ignored[0], name
    honoured = [r.getMessage() for r in caplog.records if "from the launch's fp8_config" in r.getMessage()]
    assert len(honoured) == 1 and "fp8_format=E4M3 -> format='e4m3'" in honoured[0]
    assert "use_autocast_during_eval=False -> fp8_eval=False" in honoured[0]


def test_explicit_fp8kwargs_win_over_the_launch_config_and_say_so(fp8_config_env):
    fp8_config_env.setenv("ACCELERATE_FP8_FORMAT", "E4M3")
    fp8_config_env.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "1024")
    with pytest.warns(UserWarning, match=r"fp8_config \(fp8_format=E4M3, amax_history_len=1024\) is not applied: "
                                         "FP8Kwargs were given"):
        accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(snapshot_every=5)])
    assert accelerator.fp8_engine.recipe.format == "hybrid" and accelerator.fp8_engine.recipe.amax_history_len == 16


@pytest.mark.parametrize("settings, match", [
    ({"FORMAT": "E3M4"}, r"fp8_format='E3M4' \(ACCELERATE_FP8_FORMAT\) is not valid; valid choices: \['E4M3'"),
    ({"AMAX_HISTORY_LEN": "0"}, r"amax_history_len='0' .* must be an integer >= 1"),
    ({"USE_AUTOCAST_DURING_EVAL": "maybe"}, r"use_autocast_during_eval='maybe' .* valid choices: \['True', 'False'\]"),
    ({"FORMAT": "E5M2", "USE_MXFP8_BLOCK_SCALING": "True"}, "does not make a valid recipe"),
])
def test_an_invalid_fp8_config_raises_naming_the_setting(fp8_config_env, settings, match):
    for key, value in settings.items():
        fp8_config_env.setenv(f"ACCELERATE_FP8_{key}", value)
    with pytest.raises(ValueError, match=match):
        FP8Accelerator(cpu=True, mixed_precision="fp8")


def test_the_launcher_exports_only_the_fp8_config_fields_given(capsys):
    """Accelerate's launcher exports every --fp8_* flag, defaults included (ACCELERATE_FP8_AMAX_HISTORY_LEN=1024
    for a plain `--mixed_precision fp8`); ours exports what the config file or the command line gave."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import setup_fp8_env

    from lightning_fp8.integrations.accelerate.fp8_config import keep_explicit_fp8_args

    def exported(argv, ours=True):
        args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
        if ours:
            keep_explicit_fp8_args(args, defaults)
        return setup_fp8_env(args, {})

    plain = ["--mixed_precision", "fp8", "--num_processes", "1", "train.py"]
    assert exported(plain, ours=False)["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "1024"  # Accelerate's own
    assert exported(plain) == {}
    assert exported(["--mixed_precision", "fp8", "--num_processes", "1", "--fp8_format", "E5M2", "train.py"]) == {
        "ACCELERATE_FP8_FORMAT": "E5M2"}
    assert exported(["--config_file", TEMPLATE, "--num_processes", "1", "--fp8_margin", "2", "train.py"]) == {
        "ACCELERATE_FP8_BACKEND": "TE", "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024", "ACCELERATE_FP8_FORMAT": "E4M3",
        "ACCELERATE_FP8_INTERVAL": "1", "ACCELERATE_FP8_MARGIN": "2", "ACCELERATE_FP8_OVERRIDE_FPROP": "False",
        "ACCELERATE_FP8_OVERRIDE_DGRAD": "False", "ACCELERATE_FP8_OVERRIDE_WGRAD": "False",
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "False"}  # the template's fields, the flag over the file's margin


def _launch_env():
    env = _env(OMP_NUM_THREADS="1", PYTHONWARNINGS="default")  # the fp8_config warning must reach stderr
    for name in [k for k in env if k.startswith("ACCELERATE_FP8_")]:
        del env[name]
    return env


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_accelerates_own_fp8_template_and_run_me_through_the_launcher():
    """Accelerate's own config template (fp8_config: backend TE, fp8_format E4M3, amax_history_len 1024, ...) and its
    own run_me.py, unchanged: the state reads fp8, the settings that map are honoured and said, backend is named as
    ignored."""
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--config_file", TEMPLATE, "--cpu",
           "--num_cpu_threads_per_process", "1", RUN_ME]
    proc = subprocess.run(cmd, env=_launch_env(), capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Mixed precision type: fp8" in proc.stdout, proc.stdout
    assert proc.stderr.count("FP8 settings from the launch's fp8_config") == 1, proc.stderr[-3000:]
    assert "fp8_format=E4M3 -> format='e4m3'; amax_history_len=1024; margin=0" in proc.stderr
    assert proc.stderr.count("no equivalent in lightning_fp8 are ignored: backend=TE") == 1, proc.stderr[-3000:]


PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from support.helpers import mlp
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = mlp()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(3):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
recipe = accelerator.fp8_engine.recipe
with open(f"{sys.argv[2]}/rank{accelerator.process_index}.json", "w") as f:  # the ranks' stdout interleave
    json.dump({"state": accelerator.state.mixed_precision, "class": type(accelerator).__name__,
               "format": recipe.format, "history": recipe.amax_history_len, "algo": recipe.amax_compute_algo,
               "margin": recipe.margin, "fp8_eval": accelerator._fp8_core.fp8_eval,
               "steps": accelerator.fp8_engine.step_count}, f)
accelerator.wait_for_everyone()
accelerator.end_training()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_template_fp8_config_on_two_processes(tmp_path):
    """The template through the launcher on 2 CPU processes: both ranks train with its recipe; its settings, the
    ignored-settings warning and the conversion summary are said once."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--config_file", TEMPLATE, "--multi_gpu",
           "--num_processes", "2", "--main_process_port", "0", "--num_cpu_threads_per_process", "1", str(script), HERE,
           str(tmp_path)]
    proc = subprocess.run(cmd, env=dict(_launch_env(), ACCELERATE_USE_CPU="1"), capture_output=True, text=True,
                          timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0] == reports[1] == {"state": "fp8", "class": "FP8Accelerator", "format": "e4m3", "history": 1024,
                                        "algo": "max", "margin": 0, "fp8_eval": False, "steps": 3}
    assert proc.stderr.count("FP8 settings from the launch's fp8_config") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("no equivalent in lightning_fp8 are ignored: backend=TE") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("linear layers run in FP8") == 1, proc.stderr[-3000:]


def test_one_conversion_summary_per_model(caplog):
    """convert_to_fp8 by hand, then prepare (twice, and by a second Accelerator): the summary is said once."""
    from lightning_fp8 import convert_to_fp8

    model = mlp()
    with caplog.at_level("INFO", logger="lightning_fp8"):
        convert_to_fp8(model)
        accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8")
        model = accelerator.prepare(model)
        accelerator.prepare(model)
        FP8Accelerator(cpu=True).prepare_model(model)
    assert sum("linear layers run in FP8" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_without_fp8_it_is_the_base_accelerator(mixed_precision):
    results = []
    for cls in (Accelerator, FP8Accelerator):
        AcceleratorState._reset_state(True)
        torch.manual_seed(0)
        accelerator = cls(cpu=True, mixed_precision=mixed_precision)
        model = mlp()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses, _ = _train(accelerator, model, optimizer, loader(), clip=0.05)
        results.append((losses, [p.detach().clone() for p in model.parameters()], type(optimizer), accelerator))
    (base_losses, base_params, base_opt, _), (losses, params, opt, accelerator) = results
    assert accelerator.mixed_precision == mixed_precision and accelerator.fp8_engine is None
    assert opt is base_opt is AcceleratedOptimizer and not _fp8_layers(accelerator._models[0])
    assert losses == base_losses and all(torch.equal(a, b) for a, b in zip(params, base_params))


def test_fp8_kwargs_without_fp8_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="FP8Kwargs is ignored"):
        accelerator = FP8Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[FP8Kwargs(preset="conservative")])
    assert accelerator.fp8_engine is None and accelerator.skipped_steps == 0


# -- options --------------------------------------------------------------------------------------------------------
def test_fp8_kwargs_defaults_are_the_plugin_defaults():
    from lightning_fp8 import FP8Precision
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    kwargs_defaults = {name: value for name, value in vars(FP8Kwargs()).items()}
    for plugin in (FP8Precision, FabricFP8Precision):
        plugin_defaults = {
            name: p.default for name, p in inspect.signature(plugin.__init__).parameters.items() if name != "self"
        }
        assert plugin_defaults == kwargs_defaults, plugin


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"optimizer_state": "int8"}, r"\['fp32', 'fp8'\]"),
        ({"loss_scaling": "static"}, "dynamic"),
        ({"compute_dtype": "fp32"}, "bf16"),
        ({"preset": "aggressive"}, "conservative"),
        ({"snapshot_every": 0}, "snapshot_every"),
    ],
)
def test_bad_options_name_the_valid_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Kwargs(**kwargs)


def test_accelerate_fp8_backend_handlers_are_rejected():
    from accelerate.utils import TERecipeKwargs

    handler = TERecipeKwargs.__new__(TERecipeKwargs)  # its __post_init__ raises unless TransformerEngine is installed
    with pytest.raises(ValueError, match="FP8Kwargs"):
        FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[handler])


def test_preset_and_fp8_eval_off():
    accelerator, model, optimizer = _setup(
        mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(preset="mellempudi", fp8_eval=False)]
    )
    assert accelerator.fp8_engine.recipe.format == "e5m2" and accelerator.fp8_engine.scaler.mode == "dynamic"
    _train(accelerator, model, optimizer, list(loader())[:2])
    seen = []
    model[2].register_forward_hook(lambda m, i, o: seen.append(current_state().enabled))
    before = {k: v.clone() for k, v in fp8_state_dict(model).items()}
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(4, 32)).dtype == torch.float32
    assert before and all(torch.equal(before[k], v) for k, v in fp8_state_dict(model).items())  # scales untouched
    model.train()
    model(torch.randn(4, 32))
    assert seen == [False, True]  # eval in the compute dtype, training in FP8


# -- skip, rollback, clipping ---------------------------------------------------------------------------------------
def test_nan_weight_skips_the_step_and_rolls_back():
    accelerator, model, optimizer, scheduler = _setup(
        mixed_precision="fp8", scheduler=True, kwargs_handlers=[FP8Kwargs(snapshot_every=1)]
    )
    good = {}

    def corrupt(i):
        if i == 5:
            good.update({k: v.clone() for k, v in full_state(model).items()})
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")

    batches = list(loader())
    losses, skipped = _train(accelerator, model, optimizer, batches[:6], scheduler=scheduler, before_step=corrupt)
    assert skipped == [False] * 5 + [True] and math.isnan(losses[5])
    assert accelerator.skipped_steps == 1 and accelerator.rollbacks == 1
    event = accelerator.fp8_engine.events[-1]
    assert event["kind"] == "rollback" and event["reason"] == "non-finite loss" and event["restored_to_step"] == 5
    # restored to the snapshot taken after step 5: exactly the state before the corruption, FP8 metadata included
    assert all(torch.equal(v, good[k]) for k, v in full_state(model).items())
    assert scheduler.scheduler.last_epoch == 5  # Accelerate does not step the scheduler after a skipped step
    losses, skipped = _train(accelerator, model, optimizer, batches[6:], scheduler=scheduler)
    assert not any(skipped) and all(math.isfinite(l) for l in losses)


def test_inf_gradient_skips_without_rollback_and_backs_off_the_loss_scale():
    accelerator, model, optimizer = _setup(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic")])
    weights = {}

    def inject(i):
        if i == 2:
            weights.update({n: p.detach().clone() for n, p in model.named_parameters()})
            model[4].weight.grad[1, 1] = float("inf")

    _, skipped = _train(accelerator, model, optimizer, list(loader())[:3], after_backward=inject)
    assert skipped == [False, False, True] and accelerator.optimizer_step_was_skipped
    assert (accelerator.skipped_steps, accelerator.rollbacks, accelerator.loss_scale) == (1, 0, 128.0)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # the update was not applied


@pytest.mark.parametrize("loss_scaling", ["none", "dynamic"])
def test_clipping_acts_on_unscaled_gradients(loss_scaling):
    accelerator, model, optimizer = _setup(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(loss_scaling=loss_scaling)])
    x, y = next(iter(loader()))
    accelerator.backward(F.mse_loss(model(x).float(), y))
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e-2)
    grads = [p.grad for p in model.parameters()]
    # the returned norm is the unscaled one (~0.07 here; 256x that under dynamic scaling), computed in fp32
    assert norm.dtype == torch.float32 and 0.01 < norm.item() < 1.0
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item() == pytest.approx(1e-2, rel=1e-4)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.backward(F.mse_loss(model(x).float(), y))
    accelerator.clip_grad_value_(model.parameters(), 1e-4)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 1e-4


def test_gradient_accumulation_steps_the_engine_only_on_sync():
    accelerator, model, optimizer = _setup(
        mixed_precision="fp8", gradient_accumulation_steps=2, kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic")]
    )
    engine = accelerator.fp8_engine
    for i, (x, y) in enumerate(loader()):
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x).float(), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            else:
                with pytest.raises(RuntimeError, match="sync_gradients"):
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            assert engine.step_count == (i + 1) // 2
    assert engine.step_count == 4 and accelerator.skipped_steps == 0


# -- checkpoints ----------------------------------------------------------------------------------------------------
def test_save_and_load_state_resume_bit_identically(tmp_path):
    kwargs = dict(mixed_precision="fp8", scheduler=True, kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic")])
    batches = list(loader())
    accelerator, model, optimizer, scheduler = _setup(**kwargs)
    _train(accelerator, model, optimizer, batches[:3], scheduler=scheduler, clip=0.05)
    accelerator.fp8_engine.scaler.scale = 512.0  # a loss-scaler state the defaults would not reproduce
    accelerator.save_state(tmp_path / "ckpt")
    expected = _train(accelerator, model, optimizer, batches[3:], scheduler=scheduler, clip=0.05)
    expected_state = {k: v.clone() for k, v in full_state(model).items()}
    assert (tmp_path / "ckpt" / "custom_checkpoint_0.pkl").exists()

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator, model, optimizer, scheduler = _setup(seed=1, **kwargs)  # other initial weights
    accelerator.load_state(tmp_path / "ckpt")
    assert accelerator.fp8_engine.step_count == 3 and accelerator.loss_scale == 512.0
    assert _train(accelerator, model, optimizer, batches[3:], scheduler=scheduler, clip=0.05) == expected
    assert all(torch.equal(v, expected_state[k]) for k, v in full_state(model).items())  # FP8 metadata included


def test_loading_a_checkpoint_without_fp8_state_fails_clearly(tmp_path):
    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            pass

    accelerator, model, optimizer = _setup(mixed_precision="bf16")
    accelerator.register_for_checkpointing(Counter(), Counter())
    accelerator.save_state(tmp_path / "bf16")
    AcceleratorState._reset_state(True)
    accelerator, model, optimizer = _setup(mixed_precision="fp8")
    accelerator.register_for_checkpointing(Counter())  # as many objects as saved: only their meaning differs
    with pytest.raises(ValueError, match="no FP8Accelerator engine state"):
        accelerator.load_state(tmp_path / "bf16")


# -- FP8 optimizer state --------------------------------------------------------------------------------------------
def test_optimizer_state_fp8_swaps_adamw_and_rebinds_the_scheduler():
    optim = pytest.importorskip("lightning_fp8.optim")
    if not hasattr(optim, "to_fp8_optimizer"):
        pytest.skip("lightning_fp8.optim.to_fp8_optimizer is not there yet")
    accelerator, model, optimizer, scheduler = _setup(
        mixed_precision="fp8", scheduler=True, kwargs_handlers=[FP8Kwargs(optimizer_state="fp8")]
    )
    inner = optimizer.optimizer
    assert isinstance(inner, optim.FP8AdamW) and scheduler.scheduler.optimizer is inner
    losses, _ = _train(accelerator, model, optimizer, list(loader()) * 2, scheduler=scheduler)
    assert accelerator.fp8_engine.optimizers == [inner]
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-2 / 17)  # the LambdaLR drove the new optimizer
    assert losses[-1] < losses[0]


# -- parity with the Lightning plugin -------------------------------------------------------------------------------
class GPTModule(L.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        from lightning_fp8.demo.gpt import GPT

        self.gpt = GPT(cfg)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = _lm_loss(self.gpt(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _gpt_batches():
    from lightning_fp8.demo.data import batches, load_corpus
    from lightning_fp8.demo.gpt import GPTConfig

    corpus = load_corpus(max_chars=50_000)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, context=32, d_model=32, n_layers=1, n_heads=2)
    xs, ys = zip(*batches(corpus.train, batch_size=48, context=32, steps=1, seed=0))
    return cfg, DataLoader(TensorDataset(xs[0], ys[0]), batch_size=8, shuffle=False)


@pytest.mark.parametrize(
    "model_kind, options, clip",
    [("mlp", {}, None), ("mlp", {"loss_scaling": "dynamic"}, 0.05), ("gpt", {"loss_scaling": "dynamic"}, 0.5)],
)
def test_loss_parity_with_the_lightning_plugin(model_kind, options, clip):
    """Same engine, same model, data and seed: the Trainer plugin and FP8Accelerator give bit-identical losses."""
    if model_kind == "mlp":
        data = loader()
        torch.manual_seed(0)
        module = RegressionModule()
    else:
        cfg, data = _gpt_batches()
        torch.manual_seed(0)
        module = GPTModule(cfg)
    clip_kwargs = {"gradient_clip_val": clip} if clip else {}
    trainer(plugins=[FP8Precision(**options)], max_steps=len(data), **clip_kwargs).fit(module, data)
    lightning_losses = module.losses
    lightning_params = [p.detach().clone() for p in module.parameters()]

    torch.manual_seed(0)
    if model_kind == "mlp":
        model = RegressionModule()
        loss_fn = lambda out, y: F.mse_loss(out.float(), y)  # noqa: E731  (what RegressionModule computes)
    else:
        model = GPTModule(cfg).gpt
        loss_fn = _lm_loss
    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(**options)])
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2 if model_kind == "mlp" else 3e-3))
    accelerate_losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        accelerate_losses.append(loss.item())
    assert accelerate_losses == lightning_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), lightning_params))


# -- launchers (subprocesses) ---------------------------------------------------------------------------------------
def _env(**extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launcher_with_an_accelerate_config_file(tmp_path):
    """`accelerate launch --config_file` with `mixed_precision: fp8`, through our launcher (plain `accelerate launch`
    refuses fp8 unless TransformerEngine, torchao or MS-AMP is installed)."""
    config = tmp_path / "fp8.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: fp8\nnum_processes: 1\nuse_cpu: true\n"
    )
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--config_file", str(config),
           "--num_cpu_threads_per_process", "1", os.path.join(HERE, "workers", "accelerate_probe.py")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("PROBE ")][-1]
    assert json.loads(line[6:]) == {
        "mixed_precision": "fp8", "env": "fp8", "fp8_layers": 2, "engine": True, "out_dtype": "torch.float32"
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_cpu_processes_keep_identical_weights_and_scales(tmp_path):
    """2 processes (gloo) launched the way Accelerate 1.15 starts several CPU processes on one machine. Rank 0 alone
    overflows at step 5: both ranks skip that step and only that one."""
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", "--num_cpu_threads_per_process", "1", "--mixed_precision", "fp8",
           os.path.join(HERE, "workers", "accelerate_ddp_train.py"), str(tmp_path), "5"]
    proc = subprocess.run(cmd, env=_env(ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert not torch.equal(r0.pop("losses"), r1.pop("losses"))  # the ranks trained on different shards
    assert r0.pop("skipped_at").tolist() == r1.pop("skipped_at").tolist() == [5]
    assert r0.pop("counters").tolist() == r1.pop("counters").tolist() == [1.0, 0.0, 128.0]
    histories = [k for k in r0 if k.endswith("fp8_meta.amax_history")]
    assert histories
    for key in r0:  # counters included: the step-close collective carries the overflow / clip flags
        assert torch.equal(r0[key], r1[key]), key
    assert r0["2.fp8_meta.overflow_count"][0].item() == 1 == r1["2.fp8_meta.overflow_count"][0].item()
    computing = [k for k in histories if r0[k.replace("amax_history", "enabled")]]  # first / last: switched off
    assert len(computing) == 2 and all((r0[k][:, 1] > 0).all() for k in computing)  # synced delayed-scale histories
