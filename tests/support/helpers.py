"""Small models, data and measures shared by the tests: the regression MLP and its LightningModule, a CPU Trainer,
SQNR, counts of dispatched operators, GEMM requests from flat arguments."""
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n=256, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, d, generator=g) / d**0.5
    return TensorDataset(x, x @ w)


def loader(n=256, d=32, batch_size=32, seed=0):
    return DataLoader(regression_data(n, d, seed), batch_size=batch_size, shuffle=False)


def mlp(d=32, hidden=64):
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, d))


class RegressionModule(L.LightningModule):
    """Four linears: the two middle ones go to FP8 under the default filter (first and last stay BF16)."""

    def __init__(self, d=32, hidden=64, lr=1e-2, build_in_configure_model=False):
        super().__init__()
        self.d, self.hidden, self.lr = d, hidden, lr
        self.net = None if build_in_configure_model else mlp(d, hidden)
        self.losses = []
        self.fault = None  # callable(module, x, y) -> (x, y) used by fault-injection tests

    def configure_model(self):
        if self.net is None:
            self.net = mlp(self.d, self.hidden)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.fault is not None:
            x, y = self.fault(self, x, y)
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x).float(), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def trainer(**kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def full_state(model):
    """A converted model's whole state: its state_dict plus the FP8 metadata (which the state_dict leaves out)."""
    from lightning_fp8 import fp8_state_dict

    return {**model.state_dict(), **fp8_state_dict(model)}


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref = ref.double()
    noise = (ref - approx.double()).norm()
    return float(20 * torch.log10(ref.norm() / noise))


class DispatchCount:
    """Counts the operators dispatched inside the block (TorchDispatchMode sees each torch.library custom op as one
    operator, whatever it runs inside). `non_view` leaves out the view ops (they launch no kernel on a GPU)."""

    def __init__(self):
        import collections

        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.ops = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    @staticmethod
    def is_view(func) -> bool:
        schema = func._schema
        return bool(schema.returns) and schema.returns[0].alias_info is not None and not schema.is_mutable

    @property
    def non_view(self) -> int:
        return sum(n for func, n in self.ops.items() if not self.is_view(func))

    def of(self, name: str) -> int:
        return sum(n for func, n in self.ops.items() if str(func).startswith(name))


def gemm_request(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias=None, use_fast_accum=False,
                 a_tensor_scale=None, b_tensor_scale=None):
    """A GemmRequest from flat arguments: A (M, K) and B (K, N) with their scales and tiles (None: per tensor)."""
    from lightning_fp8.modules.operand import FP8Matrix, GemmRequest

    return GemmRequest(FP8Matrix(a, a_scale_inv, a_tile, a_tensor_scale),
                        FP8Matrix(b, b_scale_inv, b_tile, b_tensor_scale), out_dtype, bias, use_fast_accum)
