"""Multi-process training helpers: DistributedDataParallel and FSDP2 (``fully_shard``) for models
with kfused adapters, launched with ``torchrun`` (or ``torch.multiprocessing`` in tests).

    rank, world, device = init_distributed()          # reads RANK / WORLD_SIZE / LOCAL_RANK
    kfused.inject(model, config)                       # adapters first, then the wrapper
    model = wrap_model(model, "ddp" | "fsdp2", device)
    ... train on this rank's shard of the global batch (shard_batch) ...
    kfused.integration.save(model, dir)                # every rank calls; rank 0 writes

Add the adapters (inject, or load / from_peft into a model without them) before wrapping:
a wrapper synchronises only the parameters it was given, so inject, load and from_peft refuse
a wrapped model, and wrap_model refuses one already wrapped. Adapters change nothing else:
frozen base parameters have ``requires_grad=False``, so DDP all-reduces only the adapter
gradients, and FSDP2 shards frozen and trainable parameters alike
(it allows both in one parameter group).
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

MODES = ("none", "ddp", "fsdp2")

# The repeated transformer blocks of each architecture: FSDP2 shards each one separately.
_BLOCK_PATTERNS = (
    r"(.*\.)?h\.\d+",                      # GPT-2
    r"(.*\.)?layers\.\d+",                 # Llama-style
    r"(.*\.)?layer\.\d+",                  # BERT / RoBERTa
    r"(.*\.)?block\.\d+",                  # T5
)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def launched_with_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default: Optional[int] = None) -> int:
    raw = os.environ.get(name)
    if raw is None and default is not None:
        return default
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name}={raw!r} must be an integer "
                         "(torchrun sets it)") from None


def init_distributed(backend: Optional[str] = None, timeout_s: int = 600
                     ) -> Tuple[int, int, torch.device]:
    """Join the process group described by the torchrun environment variables.

    backend: "nccl" on CUDA, "gloo" on the CPU by default. Returns (rank, world, device); the
    device is ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU. A RANK, WORLD_SIZE or
    LOCAL_RANK that is not an integer, or out of range, is a ValueError naming it.
    """
    if not launched_with_torchrun():
        raise RuntimeError("distributed training needs the torchrun environment (RANK, WORLD_SIZE, "
                           "MASTER_ADDR, MASTER_PORT); launch with e.g. "
                           "`torchrun --nproc-per-node 2 -m kfused.cli.demo --distributed ddp`")
    local = _env_int("LOCAL_RANK", 0)
    if local < 0:
        raise ValueError(f"environment variable LOCAL_RANK={local} must be >= 0")
    if not is_distributed():
        world, rank_ = _env_int("WORLD_SIZE"), _env_int("RANK")
        if world < 1:
            raise ValueError(f"environment variable WORLD_SIZE={world} must be >= 1")
        if not 0 <= rank_ < world:  # torch would wait for a rendezvous, then time out
            raise ValueError(f"environment variable RANK={rank_} must be in [0, WORLD_SIZE="
                             f"{world}) (ranks count from 0)")
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise ValueError(f"environment variable LOCAL_RANK={local} but this machine has "
                             f"{torch.cuda.device_count()} CUDA devices")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not is_distributed():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def cleanup() -> None:
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def transformer_blocks(model: nn.Module) -> Dict[str, nn.Module]:
    """name -> module for each repeated transformer block (outermost matches only)."""
    found: Dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if any(re.fullmatch(p, name) for p in _BLOCK_PATTERNS) and not any(
                name.startswith(f + ".") for f in found):
            found[name] = mod
    return found


def parallel_wrapper(model: nn.Module) -> Optional[str]:
    """How ``model`` is already wrapped for multi-process training (DistributedDataParallel,
    FSDP2's fully_shard, DTensor parameters), or None."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = model
    for _ in range(8):  # through torch.compile wrappers, as kfused.integration.unwrap
        if isinstance(m, DDP):
            return "DistributedDataParallel"
        if not isinstance(getattr(m, "_orig_mod", None), nn.Module):
            break
        m = m._orig_mod
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch, or one built without distributed
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            FSDPModule = ()  # nothing is an instance of no class
    for name, sub in m.named_modules():
        if isinstance(sub, FSDPModule):
            return f"FSDP2: fully_shard on {name or 'the model'}"
    for name, p in m.named_parameters():
        if hasattr(p, "device_mesh"):
            return f"DTensor parameter {name}"
    return None


def wrap_ddp(model: nn.Module, device: torch.device, **kwargs) -> nn.Module:
    """DistributedDataParallel over the model's trainable (adapter) parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _check_same_adapters(model, "wrap_ddp")
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, output_device=ids[0] if ids else None, **kwargs)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def wrap_fsdp2(model: nn.Module, device: torch.device, *, mp_dtype: Optional[torch.dtype] = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard every transformer block, then the root, with FSDP2 (``fully_shard``), in place.

    mp_dtype: parameter dtype for compute (bf16/fp16 mixed precision; gradients reduce in
    float32 and the sharded adapter weights stay float32).

    Every rank starts from rank 0's trainable parameters (broadcast before sharding, as DDP
    does). 0-d parameters (KronA^B_res's s_res), which fully_shard refuses, stay whole plain
    tensors on every rank with their gradients averaged over the ranks; a gradient clip over
    them and the DTensors together takes ``foreach=True``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard()
    mesh = init_device_mesh(device.type, (world_size(),))
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_dtype is not None:
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:  # pragma: no cover
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    _check_same_adapters(model, "wrap_fsdp2")
    trainable = [p for p in model.parameters() if p.requires_grad]
    # each rank shards its own values: start every rank from rank 0's adapters, as DDP does
    # (a per-rank seed made a mixture of rank 0's and rank 1's shards)
    _broadcast_from_rank_0(trainable, device)
    # fully_shard refuses 0-d parameters (KronA^B_res's s_res): they stay whole on every rank,
    # outside FSDP2, and their gradients are averaged over the ranks here as FSDP2 averages
    # the others'
    scalars = {p for p in model.parameters() if p.dim() == 0}
    if scalars:
        kw["ignored_params"] = scalars
        for p in scalars:
            p.data = p.data.to(device)  # fully_shard moves only the parameters it manages
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_average_grad)
    for blk in transformer_blocks(model).values():
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model


def _average_grad(p: torch.Tensor) -> None:
    # linear: an accumulated gradient (already averaged) plus this step's is averaged alike
    dist.all_reduce(p.grad)
    p.grad.div_(world_size())


def _broadcast_from_rank_0(params, device: torch.device) -> None:
    """Copy rank 0's values into ``params`` on every rank (one broadcast per dtype)."""
    by_dtype: Dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    with torch.no_grad():
        for ps in by_dtype.values():
            flat = torch.cat([p.detach().reshape(-1).to(device) for p in ps])
            dist.broadcast(flat, 0)
            for p, t in zip(ps, flat.split([p.numel() for p in ps])):
                p.copy_(t.view_as(p))


def _check_same_adapters(model: nn.Module, fn: str) -> None:
    """ValueError naming the ranks whose kfused adapter config differs from rank 0's (one
    all_gather_object): a wrapper synchronises parameters, never e.g. LoRA's alpha."""
    import json

    from kfused.integration import get_state

    state = get_state(model, required=False)
    mine = None if state is None else json.dumps(state.config.to_dict(), sort_keys=True,
                                                 default=str)
    every = [None] * world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, c in enumerate(every) if c != every[0]]
    if not differ:
        return

    lines = []
    for r in differ:
        if None in (every[0], every[r]):
            lines.append(f"rank {0 if every[0] is None else r} has no kfused adapters")
            continue
        first, got = json.loads(every[0]), json.loads(every[r])
        diff = [f"{k} {first.get(k)!r} on rank 0 but {got.get(k)!r} on rank {r}"
                for k in sorted(set(first) | set(got)) if first.get(k) != got.get(k)]
        lines.append(", ".join(diff))
    raise ValueError(f"{fn}: the kfused adapter config differs between ranks (ranks {differ} "
                     f"differ from rank 0): " + "; ".join(lines) + ". Every rank must inject "
                     "the same config (the wrapper synchronises parameters only).")


def wrap_model(model: nn.Module, mode: str, device: torch.device, **kwargs) -> nn.Module:
    """"none" (unchanged), "ddp" or "fsdp2" (these need the process group: init_distributed).
    ``kwargs`` go to :func:`wrap_ddp` / :func:`wrap_fsdp2`; "none" takes none (they would be
    dropped: e.g. an ``mp_dtype`` that never reaches a wrapper). A model already wrapped by
    DDP or FSDP2 is a ValueError (wrap once)."""
    if mode == "none":
        if kwargs:
            raise TypeError(f"wrap_model: mode 'none' leaves the model unchanged and takes no "
                            f"wrapper options, got {sorted(kwargs)}")
        return model
    if mode in ("ddp", "fsdp2") and not is_distributed():
        raise RuntimeError(f"distributed mode {mode!r} needs an initialized process group; "
                           "call kfused.distributed.init_distributed() first (under torchrun)")
    wrapper = parallel_wrapper(model) if mode in ("ddp", "fsdp2") else None
    if wrapper is not None:  # twice: FSDP2 asserted, DDP over FSDP2 failed in a collective
        raise ValueError(f"wrap_model: the model is already wrapped for multi-process training "
                         f"({wrapper}); wrap it once")
    if mode == "ddp":
        return wrap_ddp(model, device, **kwargs)
    if mode == "fsdp2":
        return wrap_fsdp2(model, device, **kwargs)
    raise ValueError(f"distributed mode must be one of {MODES}, got {mode!r}")


def shard_batch(batch: Dict[str, torch.Tensor], rank_: Optional[int] = None,
                world: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """This rank's contiguous slice of a global batch (dim 0 must divide by the world size).

    rank_ / world default to the process group's; given while it is initialized, they must
    be this process's rank and the group's size. A rank outside [0, world) or a value that
    is not a tensor with a batch dimension is an error (it would have given this rank an empty
    or wrong slice)."""
    if world is not None and is_distributed() and world != world_size():
        raise ValueError(f"shard_batch: world={world!r} but the process group has "
                         f"{world_size()} ranks")
    if rank_ is not None and is_distributed() and rank_ != rank():
        raise ValueError(f"shard_batch: rank_={rank_!r} but this process is rank {rank()} of "
                         "the process group (each rank takes its own slice; leave rank_ out)")
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    for name, n in (("world", world), ("rank_", rank_)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"shard_batch: {name} must be an int, got {type(n).__name__} {n!r}")
    if world < 1:
        raise ValueError(f"shard_batch: world must be >= 1, got {world}")
    if not 0 <= rank_ < world:
        raise ValueError(f"shard_batch: rank_ must be in [0, {world}) for world={world}, "
                         f"got {rank_}")
    out = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) or v.dim() < 1:
            what = ("a 0-d tensor" if isinstance(v, torch.Tensor)
                    else f"a {type(v).__name__}")
            raise TypeError(f"global batch {k} is {what}; shard_batch slices tensors along "
                            "their first (batch) dimension")
        if v.shape[0] % world:
            raise ValueError(f"global batch {k} has {v.shape[0]} rows, not divisible by world "
                             f"size {world}")
        n = v.shape[0] // world
        out[k] = v[rank_ * n:(rank_ + 1) * n]
    return out


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (the tensor itself when not distributed)."""
    if not is_distributed():
        return x
    y = x.detach().clone()
    dist.all_reduce(y)
    return y / world_size()
