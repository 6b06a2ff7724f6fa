"""``kfused demo``: the main job — adapt a pretrained GPT-2-shaped base to a data-to-text task
with LoRA and each kfused family, generate text for held-out meaning representations and score
it; on a GPU also fused kernels against the unfused reference.

What runs (defaults):

* the **base**: the small byte-level GPT-2-shaped model pretrained by
  :mod:`kfused.data.pretrain_base` on generated English (``kfused/data/base/``, ships with the
  package; ``--model-dir`` loads another local checkpoint, ``--base random`` a random one);
* the **task**: the bundled E2E-style set (``kfused/data/e2e_tiny.jsonl``): 60 held-out
  meaning representations (held-out loss on all 60, generation for the first 40), the rest
  for training (pairs whose representation equals a held-out one are dropped from training);
* the **rows**: the frozen base, then LoRA, KronA, Kernel-mix and inducer+LoRA (``--methods``),
  each trained with the same seed and the same batches in the same order; per row the
  trainable parameters, the training and held-out loss, and for the held-out representations
  greedy generations scored by BLEU (sacrebleu) and slot realisation accuracy
  (:mod:`kfused.data.e2e_metrics` defines it);
* **fused vs reference**: on CUDA every method trains twice, fused kernels and unfused
  reference, on identical batches; the report overlays their loss curves and gives the largest
  loss difference, tokens/s and peak memory of each. On a CPU only the reference runs (the
  Triton kernels need a GPU; their CPU interpreter is far too slow to train) and the report
  says so.

Results: a table on stdout, ``<out>/demo.json`` and ``<out>/demo.png``.

    python -m kfused.cli.demo                                 # CPU: about 1-2 minutes
    python -m kfused.cli.demo --methods lora,kernel-mix-qvo-intermediate --steps 200
    torchrun --nproc-per-node 2 -m kfused.cli.demo --distributed ddp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import resource
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from kfused._files import folder_refusal, free_stem, replace_atomically

# The demo's rows: name -> (label, AdapterConfig keyword arguments). Anything else passed to
# --methods is a preset name (kfused.integration.PRESETS) or a registered method.
METHODS: Dict[str, Tuple[str, dict]] = {
    "lora": ("LoRA", dict(method="lora", r=8)),
    # KronA at LoRA's trainable-parameter budget (the paper's comparison): per layer the
    # factor shapes with at most the parameters of a rank-8 LoRA there (--rank sets the rank)
    "krona": ("KronA", dict(method="krona", options={"lora_rank_budget": 8})),
    "kernel_mix": ("Kernel-mix", dict(method="kernel_mix", targets=["q", "v", "o"], r=4)),
    "inducer_lora": ("inducer+LoRA", dict(method="inducer_lora", r=8)),
}
DEFAULT_METHODS = ",".join(METHODS)


def build_parser() -> argparse.ArgumentParser:
    from kfused.cli.args import (DefaultsHelpFormatter, device_or_auto, finite_float,
                                 nonnegative_int, positive_float, positive_int, seed_int)

    p = argparse.ArgumentParser(
        prog="kfused demo",
        description="Adapt the shipped pretrained GPT-2-shaped base to the bundled "
                    "data-to-text task with LoRA and each kfused method; generate for held-out "
                    "meaning representations and score BLEU and slot accuracy; fused kernels "
                    "vs the unfused reference on a GPU.",
        formatter_class=DefaultsHelpFormatter)
    rows = p.add_mutually_exclusive_group()  # each names the rows: one of them, not two
    rows.add_argument("--methods", default=DEFAULT_METHODS,
                      help="comma-separated rows: " + ", ".join(METHODS) + ", a preset name "
                           "(kfused.integration.PRESETS) or any registered method")
    rows.add_argument("--method", default=None, help="one method only (same as --methods NAME)")
    rows.add_argument("--preset", default=None, help="one preset only (same as --methods NAME)")
    p.add_argument("--targets", default=None,
                   help="comma-separated roles/regexes for every row (default: each method's)")
    p.add_argument("--rank", type=positive_int, default=None,
                   help="rank r for every row that has one (default: each row's, 8 for "
                   "LoRA); KronA's factor shapes take the parameters of a rank-r LoRA")
    p.add_argument("--scale", type=finite_float, default=None,
                   help="adapter output scale s (KronA, Kernel-wise / Kernel-mix; LoRA "
                   "scales by alpha / r instead)")
    p.add_argument("--base", default="pretrained", choices=["pretrained", "random"],
                   help="pretrained: the base shipped in kfused/data/base; random: a randomly "
                        "initialised model of --layers/--d-model/--heads")
    p.add_argument("--model-dir", default=None,
                   help="local transformers causal-LM checkpoint directory, e.g. GPT-2 or Llama "
                        "(overrides --base)")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="layers of a --base random model")
    p.add_argument("--d-model", type=positive_int, default=128,
                   help="width of a --base random model (a multiple of --heads)")
    p.add_argument("--heads", type=positive_int, default=4,
                   help="attention heads of a --base random model")
    p.add_argument("--seq-len", type=positive_int, default=384,
                   help="longest training sequence in bytes (batches are cut to their longest "
                        "example; at most the model's positions)")
    p.add_argument("--loss", default="target", choices=["target", "all"],
                   help="target: loss on the sentence only (the meaning representation is the "
                        "prompt); all: on the whole sequence")
    p.add_argument("--batch-size", type=positive_int, default=8, help="global batch size")
    p.add_argument("--steps", type=positive_int, default=48, help="optimizer steps per run")
    p.add_argument("--lr", type=positive_float, default=1.2e-2, help="AdamW learning rate")
    p.add_argument("--warmup", type=nonnegative_int, default=3,
                   help="steps excluded from the timings (0: none)")
    p.add_argument("--gen-examples", type=nonnegative_int, default=40,
                   help="held-out meaning representations to generate for and score "
                        "(0: no generation)")
    p.add_argument("--max-new-tokens", type=positive_int, default=200,
                   help="generation length limit in bytes")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="seed of the adapter initialisation and of the batch order")
    p.add_argument("--device", type=device_or_auto, default="auto",
                   help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype (auto: bfloat16 on CUDA, float32 on the CPU); adapter "
                        "weights stay float32")
    p.add_argument("--runs", default="auto", choices=["auto", "both", "fused", "reference"],
                   help="auto: fused + reference on CUDA, reference only on the CPU")
    p.add_argument("--fused-backend", default="auto", choices=["auto", "triton", "cuda"],
                   help="the fused run's kernels: auto (Triton, or the CUDA C++ path where "
                        "kfused bench measured it faster), triton or cuda; on a CPU, "
                        "--fused-backend triton with TRITON_INTERPRET=1 runs the Triton kernels "
                        "in their interpreter (slow: tiny models only)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass (less memory)")
    p.add_argument("--distributed", default="none", choices=["none", "ddp", "fsdp2"],
                   help="multi-process training (launch with torchrun)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ------------------------------------------------------------------------------------------


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _build_model(args, vocab: int, device: torch.device):
    import transformers as tf

    if args.model_dir or args.base == "pretrained":
        from kfused.data.pretrain_base import BASE_DIR

        path = args.model_dir or BASE_DIR
        # float32 compute (the shipped weights are stored in float16)
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager").float()
        if model.get_input_embeddings().num_embeddings < vocab:
            model.resize_token_embeddings(vocab)
    else:
        from kfused.integration.models import tiny_model

        _seed(args.seed)
        model = tiny_model("gpt2", d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, vocab=vocab, max_len=max(args.seq_len, 384))
    return model.to(device)


def _causal_lm_refusal(path: str) -> Optional[str]:
    """Why the checkpoint in ``path`` is no causal language model the demo can load (None if
    it is one)."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cfg = tf.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{path}: its config.json cannot be read ({type(exc).__name__}: {first})"
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return (f"{path} holds a {cfg.model_type!r} model, which is no causal language model "
                "(AutoModelForCausalLM cannot load it); the demo generates text left to right")
    return None


def _inject_refusal(model, cfg) -> None:
    """Raise what ``inject(model, cfg)`` would raise, on a weightless (meta-device) copy of
    ``model``'s architecture: the model itself is left as it was."""
    import transformers as tf

    from kfused.integration import inject

    with torch.device("meta"):
        probe = tf.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    inject(probe, cfg)


# model types that number positions from padding_idx + 1 (create_position_ids_from_input_ids):
# the first padding_idx + 1 rows of their position table are never a token's
_PADDING_OFFSET_POSITIONS = ("roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl",
                             "camembert", "data2vec-text")


def _max_positions(model) -> int:
    """The longest sequence the model's positions allow."""
    cfg = model.config
    n = int(getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings"))
    if getattr(cfg, "model_type", None) in _PADDING_OFFSET_POSITIONS:
        n -= int(getattr(cfg, "pad_token_id", None) or 0) + 1
    return n


def _adapter_config(name: str, args, backend: str):
    from kfused.integration import PRESETS, AdapterConfig, get_method, preset

    targets = args.targets.split(",") if args.targets else None
    over = {k: v for k, v in (("r", args.rank), ("scale", args.scale), ("targets", targets))
            if v is not None}
    if args.rank is not None:  # --rank is every row's rank: a preset's per-projection ranks
        over["ranks"] = {}     # (e.g. kernel-mix-qvo-intermediate's) had kept theirs
    if name in PRESETS:
        return preset(name, backend=backend, **over)
    kw = dict(METHODS[name][1]) if name in METHODS else {"method": name, "r": 8}
    get_method(kw["method"])  # unknown / not installed: a clear error now
    if args.rank is not None and "lora_rank_budget" in kw.get("options", {}):
        kw["options"] = {**kw["options"], "lora_rank_budget": args.rank}
    kw.update(over)
    return AdapterConfig(backend=backend, **kw)


def _label(name: str) -> str:
    return METHODS[name][0] if name in METHODS else name


def _peak_memory(device: torch.device) -> Dict[str, object]:
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_memory_kind": "torch.cuda.max_memory_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
    return {"peak_memory_bytes": int(rss),
            "peak_memory_kind": "max RSS of the process (CPU; cumulative over runs)"}


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _fused_backend_refusal(backend: str, device: torch.device) -> Optional[str]:
    """Why the fused run cannot use ``backend`` on ``device`` (None if it can)."""
    if device.type == "cuda":
        return None  # each op names what it cannot run, as for any explicit backend
    if backend == "cuda":
        return f"the CUDA C++ kernels need a CUDA device (--device is {device})"
    from kfused.backends import triton_interpret

    if not triton_interpret():
        return (f"Triton kernels on the {device.type} run only in the interpreter: set "
                "TRITON_INTERPRET=1 (slow: a tiny model and a few steps)")
    return None


def _use_backend(backend: str):
    from kfused.integration import use_backend

    # The environment default reaches ops that take the backend per call.
    return use_backend(None if backend == "auto" else backend)


@torch.no_grad()
def eval_loss(model, data: Dict[str, torch.Tensor], device, dtype, batch: int = 16) -> float:
    """Mean loss per labelled token over ``data`` (nats/byte)."""
    model.eval()
    tot, count = 0.0, 0
    for i in range(0, data["input_ids"].shape[0], batch):
        b = _trim({k: v[i:i + batch] for k, v in data.items()})
        b = {k: v.to(device) for k, v in b.items()}
        with _autocast(device, dtype):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lab = b["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), lab.reshape(-1),
            ignore_index=-100, reduction="sum")
        tot += float(nll)
        count += int((lab != -100).sum())
    return tot / count if count else float("nan")  # no labelled token: no loss, not 0


def _trim(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Cut a right-padded batch to its longest example."""
    n = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :max(n, 1)] for k, v in batch.items()}


@torch.no_grad()
def generate(model, mrs: List[str], device, dtype, max_new: int, batch: int = 64) -> List[str]:
    """Greedy continuation of ``BOS mr SEP`` for each representation, cut at EOS."""
    from kfused.data import ByteTokenizer

    tok = ByteTokenizer()
    model.eval()
    n_pos = _max_positions(model)
    texts = []
    for i in range(0, len(mrs), batch):
        prompts = [[tok.BOS] + tok.encode(mr) + [tok.SEP] for mr in mrs[i:i + batch]]
        room = max(1, min(max_new, n_pos // 2))  # a model with few positions: cut the prompt
        prompts = [q[-(n_pos - room):] for q in prompts]
        L = max(len(q) for q in prompts)
        ids = torch.full((len(prompts), L), tok.PAD, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for j, q in enumerate(prompts):  # left padding: every prompt ends at column L
            ids[j, L - len(q):] = torch.tensor(q)
            mask[j, L - len(q):] = 1
        with _autocast(device, dtype):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max(1, min(max_new, n_pos - L)),
                                 do_sample=False, pad_token_id=tok.PAD, eos_token_id=tok.EOS,
                                 bos_token_id=tok.BOS)
        for row in out[:, L:].tolist():
            if tok.EOS in row:
                row = row[:row.index(tok.EOS)]
            texts.append(tok.decode(row).strip())
    return texts


def _generate_and_score(model, pairs, args, device, dtype) -> Dict[str, object]:
    from kfused.data.e2e_metrics import score

    if args.gen_examples <= 0 or args.distributed == "fsdp2":
        return {}
    from kfused.integration import unwrap

    held = pairs[:args.gen_examples]
    t0 = time.perf_counter()
    hyps = generate(unwrap(model), [e["mr"] for e in held], device, dtype, args.max_new_tokens)
    s = score([e["mr"] for e in held], hyps, [e["ref"] for e in held])
    s["generate_s"] = time.perf_counter() - t0
    s["samples"] = [{"mr": e["mr"], "ref": e["ref"], "generated": h}
                    for e, h in zip(held[:3], hyps[:3])]
    return s


def train_run(name: str, backend: str, method: str, args, data: Dict[str, torch.Tensor],
              eval_data: Dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
              vocab: int, progress: bool) -> Dict[str, object]:
    """One fine-tuning run; returns its metrics, per-step losses and the model."""
    with _use_backend(backend):
        return _train_run(name, backend, method, args, data, eval_data, device, dtype, vocab,
                          progress)


def _train_run(name, backend, method, args, data, eval_data, device, dtype, vocab, progress):
    from kfused import distributed as kd
    from kfused.integration import count_parameters, inject

    t_run = time.perf_counter()
    model = _build_model(args, vocab, device)
    _seed(args.seed)  # the same adapter initialisation for the fused and the reference run
    inject(model, _adapter_config(method, args, backend))
    trainable, total = count_parameters(model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model = kd.wrap_model(model, args.distributed, device,
                          **({"mp_dtype": dtype} if args.distributed == "fsdp2"
                             and dtype != torch.float32 else {}))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step_fn = torch.compile(model) if args.compile else model
    n = data["input_ids"].shape[0]
    g = torch.Generator().manual_seed(args.seed)  # same batches, same order, for every run
    order = torch.cat([torch.randperm(n, generator=g)
                       for _ in range(math.ceil(args.steps * args.batch_size / n) + 1)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses: List[float] = []
    times: List[float] = []
    tokens = 0
    bar = None
    if progress and kd.is_main():
        from tqdm.auto import tqdm

        bar = tqdm(total=args.steps, desc=f"{_label(method)} ({name})", unit="step",
                   leave=False)
    for step in range(args.steps):
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        batch = _trim({k: v[idx] for k, v in data.items()})
        if args.distributed != "none":
            batch = kd.shard_batch(batch)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            if args.distributed == "none":
                loss = step_fn(**batch).loss
            else:  # the model's loss would be a mean over this rank's tokens alone
                loss = _share_of_global_token_mean(step_fn, batch)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        loss_val = float(kd.all_reduce_mean(loss.detach().float()).item())
        losses.append(loss_val)
        if step >= args.warmup:
            times.append(dt)
            tokens += int(batch["attention_mask"].sum()) * kd.world_size()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.4f}")
    if bar is not None:
        bar.close()
    ev = eval_loss(model, eval_data, device, dtype)
    mem = _peak_memory(device)
    return {
        "name": name, "backend": backend, "method": method, "steps": args.steps,
        "trainable_params": trainable, "total_params": total,
        "final_loss": losses[-1], "eval_loss": ev,
        "mean_step_ms": 1e3 * sum(times) / max(len(times), 1),
        "tokens_per_s": tokens / sum(times) if times else float("nan"),
        "train_s": time.perf_counter() - t_run,
        **mem, "losses": losses, "_model": model,
    }


def _share_of_global_token_mean(step_fn, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's term of the global batch's mean loss per target token: its summed token
    loss times the world size over the target tokens of every rank. DDP / FSDP2 average the
    ranks' gradients, which then equal one process's on the global batch, and the mean of
    the ranks' terms is the global mean loss (per-rank means weighed each rank alike)."""
    from kfused import distributed as kd

    logits = step_fn(**{k: v for k, v in batch.items() if k != "labels"}).logits
    lab = batch["labels"][:, 1:]
    count = (lab != -100).sum()
    torch.distributed.all_reduce(count)
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), lab.reshape(-1),
        ignore_index=-100, reduction="sum")
    return nll * (kd.world_size() / count)


def _checkpoint_roundtrip(model, method, args, vocab, device, out_dir, eval_data):
    """save -> load into a fresh model -> compare; merge where the method allows."""
    from kfused.integration import (adapter_state_dict, get_method, get_state, is_mergeable,
                                    load, merge, save, unwrap)

    ckpt = os.path.join(out_dir, f"adapter_{method}")
    save(model, ckpt)
    inner = unwrap(model)
    info: Dict[str, object] = {"checkpoint": ckpt}
    if args.distributed == "fsdp2":
        return info
    fresh = _build_model(args, vocab, device)
    load(fresh, ckpt)
    a, b = adapter_state_dict(inner), adapter_state_dict(fresh)
    info["reload_bit_exact"] = all(torch.equal(a[k], b[k]) for k in a)
    cfg_method = get_state(fresh).config.method
    if is_mergeable(cfg_method):
        fresh.eval()
        ev = _trim({k: v[:8].to(device) for k, v in eval_data.items()})
        with torch.no_grad():
            y0 = fresh(**ev).logits
            merge(fresh)
            y1 = fresh(**ev).logits
        info["merge_max_abs_logit_change"] = float((y1 - y0).abs().max().item())
    else:
        info["merge"] = f"not mergeable ({get_method(cfg_method).description})"
    return info


# ------------------------------------------------------------------------------------------
# output files

WRITER = "kfused demo"
REPORT, PLOT = "demo.json", "demo.png"


def _ours(json_path: str) -> bool:
    """True when ``json_path`` is a report an earlier ``kfused demo`` wrote."""
    try:
        with open(json_path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and (data.get("written_by") == WRITER or str(
        data.get("title", "")).startswith(WRITER + ":"))


def _report_refusal(out: str) -> Optional[str]:
    """Why the report and plot may not be written under their names in ``out`` (None if
    they may): either exists and is not a regular file of an earlier run's."""
    report = os.path.join(out, REPORT)
    for name in (REPORT, PLOT):
        path = os.path.join(out, name)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) or not os.path.isfile(path):
            return f"{path} exists and is not a regular file; not replacing it"
        if not _ours(report):  # the plot is ours when the report beside it is
            return (f"{path} exists and was not written by '{WRITER}' (no report of an "
                    f"earlier run beside it); not overwriting it")
    return None


def _report_paths(out: str) -> Tuple[str, str]:
    """Where this run's report and plot go, asked again when they are written: demo.json and
    demo.png, or, when a file of someone else's appeared there during the run (checked at
    the start), the first free demo-<n>.json / demo-<n>.png (never over it)."""
    refusal = _report_refusal(out)
    if refusal is None:
        return os.path.join(out, REPORT), os.path.join(out, PLOT)
    stem = free_stem(out, os.path.splitext(REPORT)[0], (".json", ".png"), start=2)
    print(f"kfused demo: {refusal}; writing {stem}.json and {stem}.png instead")
    return os.path.join(out, stem + ".json"), os.path.join(out, stem + ".png")


def _out_refusal(out: str, methods: List[str]) -> Optional[str]:
    """Why ``--out`` cannot take this run's files (None if it can): kfused never overwrites
    a file it did not write, nor writes through a symbolic link it finds there."""
    unusable = folder_refusal(out)  # a file, a dangling link, under one, not writable
    if unusable:
        return f"--out {unusable}"
    taken = _report_refusal(out)
    if taken:
        return taken
    from kfused.integration.checkpoint import CheckpointError, _check_target

    for m in methods:  # what kfused.save would refuse after the training
        ckpt = os.path.join(out, f"adapter_{m}")
        try:
            _check_target(ckpt)
        except CheckpointError as exc:
            return f"the {m} adapter checkpoint: {exc}"
    return None


class _NoPlot(Exception):
    """matplotlib is unavailable: the plot is left as it was."""


# ------------------------------------------------------------------------------------------
# report


def _plot(report: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover
        return f"matplotlib unavailable ({exc})"
    runs = report["runs"]
    rows = report["rows"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (method, by_backend) in enumerate(runs.items()):
        for name, r in by_backend.items():
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], color=colors[i % len(colors)],
                    linestyle="-" if name == "fused" else "--", linewidth=1.4,
                    label=f"{_label(method)} ({name})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("fine-tuning loss" + ("; fused solid, reference dashed"
                                      if any(len(v) > 1 for v in runs.values()) else ""),
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    scored = [r for r in rows if "bleu" in r]
    if scored:
        xs = range(len(scored))
        w = 0.4
        bx.bar([x - w / 2 for x in xs], [r["bleu"] for r in scored], w, label="BLEU")
        bx.bar([x + w / 2 for x in xs], [100 * r["slot_accuracy"] for r in scored], w,
               label="slot accuracy (%)")
        bx.set_xticks(list(xs))
        bx.set_xticklabels([f"{r['label']}\n{r['trainable_params']:,d} params" for r in scored],
                           fontsize=8)
        bx.set_ylim(0, 100)
        bx.legend(fontsize=8)
        bx.set_title(f"{len(report['heldout_mrs'])} held-out meaning representations, greedy",
                     fontsize=10)
    else:
        bx.axis("off")
    fig.suptitle(report["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _fmt(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None or (isinstance(v, float) and math.isnan(v)) \
        else f"{v:>{width}{spec}}"


def _print_table(report: dict) -> None:
    print()
    print(f"{'row':<14} {'trainable':>10} {'%':>6} {'backend':<10} {'train loss':>10} "
          f"{'eval loss':>9} {'BLEU':>6} {'slot acc':>8} {'all slots':>9} {'added/ex':>8} "
          f"{'tokens/s':>9} {'run s':>6}")
    for r in report["rows"]:
        pct = 100 * r["trainable_params"] / r["total_params"]
        print(f"{r['label']:<14} {r['trainable_params']:>10,d} {pct:>6.2f} "
              f"{r.get('backend') or '-':<10} {_fmt(r.get('final_loss'), '.3f', 10)} "
              f"{_fmt(r.get('eval_loss'), '.3f', 9)} {_fmt(r.get('bleu'), '.1f', 6)} "
              f"{_fmt(100 * r['slot_accuracy'] if 'slot_accuracy' in r else None, '.1f', 7)}% "
              f"{_fmt(100 * r['all_slots'] if 'all_slots' in r else None, '.1f', 8)}% "
              f"{_fmt(r.get('added_per_example'), '.2f', 8)} "
              f"{_fmt(r.get('tokens_per_s'), '.0f', 9)} {_fmt(r.get('run_s'), '.1f', 6)}")


def run_demo(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``kfused demo``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model_dir and args.base == "random" and args.d_model % args.heads:
        parser.error(f"argument --d-model: {args.d_model} is not a multiple of --heads "
                     f"{args.heads} (each head gets d_model / heads)")
    if args.model_dir and not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        # else transformers takes it for a model hub id (unreachable) or fails on the folder
        parser.error(f"argument --model-dir: {args.model_dir} is not a local transformers "
                     "checkpoint folder (no config.json in it)")
    if args.model_dir:  # a checkpoint AutoModelForCausalLM cannot load: a traceback later
        refusal = _causal_lm_refusal(args.model_dir)
        if refusal:
            parser.error(f"argument --model-dir: {refusal}")
    from kfused import distributed as kd
    from kfused.data import ByteTokenizer, encode_pairs, load_pairs

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.distributed != "none":
        if not kd.launched_with_torchrun():  # a usage error, not a traceback
            print(f"kfused demo: --distributed {args.distributed} needs the torchrun "
                  f"environment (RANK, WORLD_SIZE, ...); launch with e.g. `torchrun "
                  f"--nproc-per-node 2 -m kfused.cli.demo --distributed {args.distributed}`",
                  file=sys.stderr)
            return 2
        _, world, device = kd.init_distributed()
        if args.batch_size % world:
            print(f"--batch-size {args.batch_size} must divide by the world size {world}",
                  file=sys.stderr)
            return 2
    else:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                              if args.device == "auto" else args.device)
    if device.type == "cuda" and args.device not in ("auto", "cuda") and args.distributed == "none":
        torch.cuda.set_device(device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    main = kd.is_main()
    say = print if main else (lambda *a, **k: None)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.method or args.preset:
        methods = [args.preset or args.method]
    if not methods:  # the frozen base alone, a report with no adapter rows
        print(f"kfused demo: --methods {args.methods!r} names no method; give a comma list "
              f"of presets or methods, e.g. {DEFAULT_METHODS}", file=sys.stderr)
        return 2
    runs_wanted = args.runs
    notes: List[str] = []
    if runs_wanted == "auto":
        runs_wanted = "both" if device.type == "cuda" else "reference"
    fb = args.fused_backend
    plan = {"both": [("fused", fb), ("reference", "reference")],
            "fused": [("fused", fb)], "reference": [("reference", "reference")]}[runs_wanted]
    # the fused run runs kernels on CUDA, or in the Triton interpreter when asked for by name
    fused_kernels = device.type == "cuda" or fb != "auto"
    if fb != "auto" and runs_wanted != "reference":
        refusal = _fused_backend_refusal(fb, device)
        if refusal:
            print(f"kfused demo: --fused-backend {fb}: {refusal}", file=sys.stderr)
            return 2
    if "fused" not in dict(plan):
        fused_skip = ("CPU: running the unfused reference only; the fused run is skipped "
                      "because the Triton kernels need a CUDA GPU (their CPU interpreter is far "
                      "too slow to train)" if device.type != "cuda" and args.runs == "auto"
                      else f"not requested (--runs {args.runs})")
        notes.append(fused_skip)
    else:
        fused_skip = None
        if not fused_kernels:
            notes.append("the fused run on the CPU uses the reference path (the fused kernels "
                         "need a CUDA GPU)")
        elif device.type != "cuda":
            notes.append("the fused run on the CPU runs the Triton kernels in their interpreter "
                         "(TRITON_INTERPRET=1): a check of the numbers, not of the speed")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:  # one row, one run and one checkpoint folder per name
        print(f"kfused demo: --methods names {', '.join(twice)} more than once", file=sys.stderr)
        return 2
    try:  # a bad method / preset / target is a usage error, not a traceback
        for m in methods:
            _adapter_config(m, args, "reference")
    except (ValueError, NotImplementedError) as exc:
        print(f"kfused demo: {exc}", file=sys.stderr)
        return 2
    refusal = _out_refusal(args.out, methods)  # every rank: none goes on alone
    if refusal:  # before any training: nothing is written
        print(f"kfused demo: {refusal}", file=sys.stderr)
        return 2

    tok = ByteTokenizer()
    vocab = tok.vocab_size
    base_model = _build_model(args, vocab, device)
    try:  # targets no module matches, a preset's shapes for another width: before any work
        for m in methods:
            _inject_refusal(base_model, _adapter_config(m, args, "reference"))
    except (ValueError, NotImplementedError) as exc:
        print(f"kfused demo: {_label(m)}: {exc}", file=sys.stderr)
        return 2
    n_pos = _max_positions(base_model)
    if args.seq_len > n_pos:
        notes.append(f"--seq-len {args.seq_len} cut to the model's {n_pos} positions")
        args.seq_len = n_pos
    pairs = load_pairs()
    n_eval = min(60, len(pairs) // 10)
    held = pairs[:n_eval]
    held_mrs = {e["mr"] for e in held}
    if args.warmup >= args.steps:  # every step is warm-up: nothing timed
        notes.append(f"--warmup {args.warmup} covers all {args.steps} steps: no step is "
                     "timed (no tokens/s)")
    if args.gen_examples > n_eval:  # not silently fewer than asked
        notes.append(f"--gen-examples {args.gen_examples}: there are {n_eval} held-out "
                     f"examples; generating for all {n_eval}")
    train = [e for e in pairs[n_eval:] if e["mr"] not in held_mrs]
    target_only = args.loss == "target"
    data = encode_pairs(train, args.seq_len, tok, target_only=target_only)
    eval_data = encode_pairs(held, args.seq_len, tok, target_only=target_only)
    truncated = int((data["attention_mask"].sum(1) >= args.seq_len).sum())
    if target_only:  # a sentence wholly beyond --seq-len leaves nothing to train on
        keep = (data["labels"][:, 1:] != -100).any(1)
        if not bool(keep.any()):
            print(f"kfused demo: --seq-len {args.seq_len} leaves no sentence byte of any "
                  f"training example with --loss target (the meaning representations take "
                  f"up to {max(len(tok.encode(e['mr'])) for e in train) + 2} tokens); raise "
                  "--seq-len or use --loss all", file=sys.stderr)
            return 2
        if not bool(keep.all()):
            notes.append(f"{int((~keep).sum())} training examples whose sentence lies wholly "
                         f"beyond --seq-len {args.seq_len} are left out (no target token)")
            data = {k: v[keep] for k, v in data.items()}
        if not bool((eval_data["labels"][:, 1:] != -100).any()):
            notes.append(f"no held-out sentence starts within --seq-len {args.seq_len}: no "
                         "held-out loss")
    model_type = getattr(base_model.config, "model_type", None)  # --model-dir: any causal LM
    shaped = "GPT-2-shaped" if model_type == "gpt2" else f"{model_type}"
    if args.model_dir:
        built = f"from {args.model_dir}"
    elif args.base == "pretrained":
        built = "the shipped pretrained base (kfused/data/base)"
    else:
        built = f"{args.layers} layers, d={args.d_model}, random weights"
    say(f"kfused demo: {', '.join(_label(m) for m in methods)} on a {shaped} model "
        f"({built}), {len(train)} train / {n_eval} held-out examples, batch "
        f"{args.batch_size}, {args.steps} steps, lr {args.lr}, seed {args.seed}, device "
        f"{device}, compute dtype {str(dtype).replace('torch.', '')}"
        + (f", {args.distributed} x {kd.world_size()}" if args.distributed != "none" else ""))
    if truncated:
        notes.append(f"{truncated} training examples longer than --seq-len {args.seq_len} "
                     "are truncated")
    for note in notes:
        say(f"note: {note}")

    t_start = time.perf_counter()
    total_params = sum(p.numel() for p in base_model.parameters())
    t0 = time.perf_counter()
    base_row: Dict[str, object] = {
        "label": "frozen base", "method": None, "backend": None, "trainable_params": 0,
        "total_params": total_params, "final_loss": None,
        "eval_loss": eval_loss(base_model, eval_data, device, dtype)}
    base_row.update(_generate_and_score(base_model, held, args, device, dtype))
    base_row["run_s"] = time.perf_counter() - t0
    del base_model
    rows = [base_row]
    runs: Dict[str, Dict[str, dict]] = {}
    checkpoints: Dict[str, dict] = {}
    comparisons: Dict[str, dict] = {}
    if main:
        os.makedirs(args.out, exist_ok=True)
    for method in methods:
        t0 = time.perf_counter()
        runs[method] = {}
        row: Dict[str, object] = {}
        for name, backend in plan:
            r = train_run(name, backend, method, args, data, eval_data, device, dtype, vocab,
                          progress=not args.no_progress)
            model = r.pop("_model")
            if not row:  # the first run of the plan (fused where it runs) is generated from
                row = {"label": _label(method), **{k: v for k, v in r.items()
                                                   if k not in ("losses", "name")}}
                row.update(_generate_and_score(model, held, args, device, dtype))
                checkpoints[method] = _checkpoint_roundtrip(model, method, args, vocab, device,
                                                            args.out, eval_data)
            del model
            runs[method][name] = r
        if len(runs[method]) == 2:
            a, b = runs[method]["fused"], runs[method]["reference"]
            diffs = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
            comparisons[method] = {  # a nan anywhere is the largest difference, not skipped
                # off CUDA, backend "auto" is the reference: no fused kernel ran
                "fused_ran_reference_path": not fused_kernels,
                "max_abs_loss_difference": float("nan") if any(map(math.isnan, diffs))
                else max(diffs),
                "final_loss_difference": abs(a["losses"][-1] - b["losses"][-1]),
                "tokens_per_s": {"fused": a["tokens_per_s"], "reference": b["tokens_per_s"]},
                "peak_memory_bytes": {"fused": a["peak_memory_bytes"],
                                      "reference": b["peak_memory_bytes"]}}
        row["run_s"] = time.perf_counter() - t0
        rows.append(row)
        say(f"  {_label(method):<14} done in {row['run_s']:.1f} s: eval loss "
            f"{row['eval_loss']:.3f}" + (f", BLEU {row['bleu']:.1f}, slot accuracy "
                                         f"{100 * row['slot_accuracy']:.1f}%"
                                         if "bleu" in row else ""))
    wall = time.perf_counter() - t_start

    base_info = {}
    if not args.model_dir and args.base == "pretrained":
        from kfused.data.pretrain_base import BASE_DIR

        with open(os.path.join(BASE_DIR, "pretrain.json")) as f:
            base_info = json.load(f)
            base_info.pop("loss_every_50_steps", None)
    report = {
        "written_by": WRITER,
        "title": f"kfused demo: {shaped} byte-level base ({total_params:,d} params), "
                 f"E2E-style data-to-text, {args.steps} steps, {device.type}",
        "device": str(device), "device_name": (torch.cuda.get_device_name(device)
                                                if device.type == "cuda" else platform.processor()
                                                or platform.machine()),
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
        "cpu_threads": torch.get_num_threads(), "args": vars(args), "notes": notes,
        "wall_s": wall, "base": base_info,
        "metrics": "BLEU: sacrebleu corpus BLEU, one reference; slot accuracy, all slots, "
                   "added/example: kfused.data.e2e_metrics (realised slots / all slots; "
                   "examples with every slot realised; slot values stated but not in the "
                   "representation)",
        "heldout_mrs": [e["mr"] for e in held[:max(args.gen_examples, 0)]],
        "rows": [{k: v for k, v in r.items()} for r in rows],
        "runs": runs, "fused_vs_reference": comparisons,
        "skipped": {"fused": fused_skip} if fused_skip else {},
        "checkpoint": checkpoints,
    }
    try:
        report["load_average"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    if main:
        report_path, plot_path = _report_paths(args.out)

        def dump(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(report, f, indent=2, default=str)

        replace_atomically(report_path, dump)
        err = None

        def draw(tmp: str) -> None:
            nonlocal err
            err = _plot(report, tmp)
            if err is not None:
                raise _NoPlot

        with contextlib.suppress(_NoPlot):
            replace_atomically(plot_path, draw)
        _print_table(report)
        print()
        if comparisons:
            print("fused vs reference (identical batches in identical order)" + (
                f"; on the {device.type} the fused run takes the reference path too: the two "
                "rows compare the reference with itself" if not fused_kernels else
                f"; on the {device.type} the fused run ran the Triton kernels in their "
                "interpreter (numbers, not speed)" if device.type != "cuda" else "") + ":")
            for m, c in comparisons.items():
                mem = c["peak_memory_bytes"]
                print(f"  {_label(m):<14} largest |fused - reference| loss difference "
                      f"{c['max_abs_loss_difference']:.3e} (final {c['final_loss_difference']:.3e})"
                      f"; tokens/s {_fmt(c['tokens_per_s']['fused'], '.0f', 0)} vs "
                      f"{_fmt(c['tokens_per_s']['reference'], '.0f', 0)}; peak memory "
                      f"{mem['fused'] / 2**20:.1f} vs {mem['reference'] / 2**20:.1f} MiB")
        elif fused_skip:
            print(f"fused vs reference: fused run skipped: {fused_skip}")
        else:
            print(f"fused vs reference: reference run not requested (--runs {args.runs})")
        first = rows[1] if len(rows) > 1 else rows[0]
        print(f"peak memory: {first.get('peak_memory_kind', '-')}; metrics: "
              "kfused.data.e2e_metrics")
        for m, info in checkpoints.items():
            print(f"adapter checkpoint {info.get('checkpoint')}"
                  + (f": reload bit-exact {info['reload_bit_exact']}"
                     if "reload_bit_exact" in info else "")
                  + (f"; merge changes logits by at most "
                     f"{info['merge_max_abs_logit_change']:.2e}"
                     if "merge_max_abs_logit_change" in info else ""))
        print(f"wrote {report_path}"
              + (f" and {plot_path}" if err is None
                 else f" (no plot: {err})") + f"; total {wall:.1f} s")
    if args.distributed != "none":
        kd.cleanup()
    return 0


def main() -> None:  # pragma: no cover
    sys.exit(run_demo())


if __name__ == "__main__":  # pragma: no cover
    main()
