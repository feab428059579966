"""Lightning callbacks for FP8 training: FP8ScaleMonitor (every FP8 layer's scales and quantization health, to the
loggers and `fp8_history.jsonl`), FP8LayerFallback (moves a layer that cannot live in FP8 and says why) and
FP8Calibration (initialises every scale from a few batches before the first optimizer step); BatchNormRefresh
(BatchNorm running statistics re-estimated before validation, checkpoints and the end of fit, FP8 or not)."""
from lightning_fp8.callbacks.batchnorm_refresh import BatchNormRefresh
from lightning_fp8.callbacks.calibration import FP8Calibration, is_calibrating
from lightning_fp8.callbacks.fallback import FP8LayerFallback
from lightning_fp8.callbacks.monitor import FP8ScaleMonitor
from lightning_fp8.callbacks.history_file import HISTORY_FILENAME
from lightning_fp8.callbacks.sampling import StatsRecord

__all__ = ["FP8ScaleMonitor", "FP8LayerFallback", "FP8Calibration", "is_calibrating", "BatchNormRefresh"]
