"""FP8 optimizer state: FP8AdamW (E4M3 first moment, FP16/BF16/FP8 second moment, optional bf16/fp16 master
weights with stochastic rounding) and the helpers the precision plugins use to swap it in."""
from lightning_fp8.optim.adamw import FP8AdamW, state_bytes_per_param
from lightning_fp8.optim.blockwise import dequantize_blockwise, quantize_blockwise
from lightning_fp8.optim.optimizer_swap import rebind_lr_schedulers, to_fp8_optimizer, unsupported_optimizer_message

__all__ = ["FP8AdamW", "state_bytes_per_param"]
