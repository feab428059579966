"""How the multi-process test scripts end: once every rank got through, each ends its process group before the
interpreter shuts down. destroy_process_group joins gloo's worker threads while Python is fully alive; a worker that
still holds a finished collective when the interpreter finalizes aborts the process (lightning_fp8/engine/distributed.py
says how). Lightning leaves a gloo group alive at exit, so a Trainer script ends it itself."""
import contextlib
from typing import Iterator

import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def process_group_ended() -> Iterator[None]:
    """Wrap a rank's whole run: on success a barrier (no rank ends the group while another still uses it), then
    destroy_process_group; after an error only the latter (a barrier could wait forever on a rank that failed)."""
    try:
        yield
        if _initialized():
            dist.barrier()
    finally:
        if _initialized():
            dist.destroy_process_group()
