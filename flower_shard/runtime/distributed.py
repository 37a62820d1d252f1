"""Process-group start-up: NCCL on CUDA, gloo on CPU, chosen by device."""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from flower_shard.config.choices import AUTO, CUDA
from flower_shard.threads import threads_per_rank


def pick_device(preference: str = AUTO) -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` when asked or available, else CPU."""
    if preference == CUDA or (preference == AUTO and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(preference: str = AUTO) -> torch.device:
    """Join the torch world started by torchrun and return this rank's device.

    On CPU each rank gets cores / local ranks threads, since the ranks of a host share its cores
    and oversubscription slows every rank down.
    """
    device = pick_device(preference)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, device_id=device if device.type == "cuda" else None
        )
    if dist.get_rank() != 0:
        quiet_libraries()
    return device


def quiet_libraries() -> None:
    """No progress bars or info from transformers and huggingface_hub on this rank: rank 0
    shows them once, not once per rank."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def shutdown(clean: bool = False) -> None:
    """Leave the torch world.

    ``clean=True`` (every rank got here without an error) waits for all ranks first: a rank
    that closes its gloo sockets while a peer still reads from them can make that peer's
    transport thread abort (SIGABRT) instead of finishing. After an error there is no
    barrier, since a dead peer would make it hang.
    """
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def exit_now(code: int = 0):
    """End this rank's process now, after :func:`shutdown`, without the interpreter's
    finalization.

    Why: gloo's worker threads outlive ``destroy_process_group`` (the process group objects stay
    referenced by device meshes and sharded modules), and one of them may free a finished
    work item, which holds Python tensors, while the main thread is already finalizing the
    interpreter: it then cannot take the GIL and the process aborts ("terminate called without
    an active exception", SIGABRT, torchrun reports the run failed; pytorch/pytorch#179291).
    Seen about once in 15 runs on 2 cores. Output and logs are flushed first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def world_sum(value, device: torch.device) -> float:
    """Sum a scalar (a number or a one-element tensor) over the whole world, in float64."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t)
    return t.item()
