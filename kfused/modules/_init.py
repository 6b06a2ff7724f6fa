"""The one init vocabulary of every adapter module, and of ``AdapterConfig.init``.

    "zero"    exact start: the adapted model computes exactly what the frozen one does. The
              tensors that produce the adapter's output are zero (LoRA and KronA ``B``, the
              parallel adapter's ``up``, the per-head ``B`` and bias ``c``, the inducer's
              ``W2`` and ``b2``); the tensors feeding them are drawn as for "random" (LoRA-style
              factor pairs) or "paper" (the inducer's key MLP and ``W1``), so the zero factor
              gets a gradient from the first step.
    "random"  every factor kaiming-uniform(a=√5), i.e. uniform with bound 1/√fan_in where
              fan_in is the factor's last dimension; biases zero. The update is non-zero from
              the start (tests and benchmarks).
    "paper"   every adapter tensor ``fmod(randn, 2) · 0.01``, as in the released code of the
              Kernel-mix (000) and inducer-tuning (001) papers: near, not at, the frozen model.

Each module lists the values it can honour in its ``INITS`` and raises ValueError (naming the
value and the accepted ones) for any other; nothing maps one value onto another.

    LoRALinear, KronALinear, KronABlock, ScaledParallelAdapter   zero, random
    KronABlock(residual=True) (KronA^B_res)                     random (its s_res·x term starts
                                                                at s_res = 1: no exact start)
    HeadwiseProjection, HeadwiseQKV, HeadwiseOutput             zero, random, paper
    InducerAttention (inducer, no prefix)                       zero, paper
    InducerAttention with prefix columns                        paper (a prefix takes softmax
                                                                weight from step 0: no exact start)
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

INITS: Dict[str, str] = {
    "zero": "exact start: the adapter's output tensors are zero, the model equals the frozen one",
    "random": "every factor kaiming-uniform(a=sqrt(5)), biases zero: a non-zero update",
    "paper": "every adapter tensor fmod(randn, 2) * 0.01, as the papers' released code",
}

PAIR_INITS = ("zero", "random")


def check_init(init: str, accepted: Sequence[str], owner: str) -> str:
    """``init`` if it is a known value that ``owner`` accepts, else a ValueError saying why."""
    if init not in INITS:
        raise ValueError(f"init={init!r} is not an init value; valid values: "
                         + "; ".join(f"{k!r} ({v})" for k, v in INITS.items()))
    if init not in accepted:
        raise ValueError(f"{owner} cannot honour init={init!r} ({INITS[init]}); it accepts "
                         + ", ".join(repr(a) for a in accepted))
    return init


@torch.no_grad()
def kaiming_(t: Optional[torch.Tensor]) -> None:
    """kaiming-uniform(a=√5) with fan_in = the last dimension (per head for 3-D factors)."""
    if t is not None:
        bound = 1.0 / math.sqrt(t.shape[-1])
        t.uniform_(-bound, bound)


@torch.no_grad()
def paper_(t: Optional[torch.Tensor]) -> None:
    """The released code's ``fmod(randn, 2) · 0.01``."""
    if t is not None:
        t.copy_(torch.fmod(torch.randn_like(t), 2.0) * 0.01)


@torch.no_grad()
def init_pair_(first: Optional[torch.Tensor], second: Optional[torch.Tensor], init: str,
               bias: Optional[torch.Tensor] = None) -> None:
    """One update ``second · first`` (and its output ``bias``): "zero" draws ``first`` and
    zeroes ``second`` and ``bias``; "random" draws both and zeroes ``bias``; "paper" draws all
    three with :func:`paper_`."""
    if init == "paper":
        for t in (first, second, bias):
            paper_(t)
        return
    kaiming_(first)
    if second is not None:
        if init == "random":
            kaiming_(second)
        else:
            second.zero_()
    if bias is not None:
        bias.zero_()
