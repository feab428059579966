"""Observability and per-layer control for FP8 training (Lightning callbacks).

    from lightning_fp8.callbacks import FP8ScaleMonitor, FP8LayerFallback, FP8Calibration
    trainer = L.Trainer(plugins=FP8Precision(), callbacks=[FP8Calibration(), FP8ScaleMonitor(), FP8LayerFallback()])

FP8ScaleMonitor logs every FP8 layer's scales and quantization health to the trainer's loggers and to
`<log_dir>/fp8_history.jsonl`; FP8LayerFallback moves a layer that cannot live in FP8 to BF16 and says why;
FP8Calibration initialises every scale from a few batches before the first optimizer step. The numbers come from
`lightning_fp8.numerics.stats`; `lightning-fp8 report LOG_DIR` turns the history into an HTML dashboard.
"""
from lightning_fp8.callbacks.calibration import FP8Calibration, is_calibrating
from lightning_fp8.callbacks.fallback import FP8LayerFallback
from lightning_fp8.callbacks.monitor import FP8ScaleMonitor
from lightning_fp8.callbacks.history_file import HISTORY_FILENAME
from lightning_fp8.callbacks.sampling import StatsRecord

__all__ = [
    "FP8ScaleMonitor", "FP8LayerFallback", "FP8Calibration", "is_calibrating", "StatsRecord", "HISTORY_FILENAME",
]
