"""Framework adapters: one module per framework, each a thin translation of the framework's hooks into
FP8TrainingEngine calls (lightning_fp8/engine). No numerics live here.

    lightning.py   FP8Precision for the Lightning Trainer      (public: lightning_fp8.FP8Precision)
    fabric.py      FP8Precision for Lightning Fabric          (public: lightning_fp8.fabric.FP8Precision)
    accelerate/    FP8Accelerator, FP8Kwargs for Accelerate    (public: lightning_fp8.accelerate)
    _core.py       what all three share: the options (the signature of FP8PrecisionCore.__init__, the one
                   definition), conversion, FP8 + autocast context, engine, checkpoint state; imports no framework
    _options.py    the validation of the options, written once
    _distributed.py  FSDP2 / DDP set-up the three share
    _rank_zero.py  rank-zero logging without a framework (the core alone, the Accelerate adapter)
"""
