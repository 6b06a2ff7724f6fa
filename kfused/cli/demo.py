"""``kfused demo``: fine-tune a GPT-2-shaped model with kfused adapters on a small data-to-text
task, once with the fused kernels and once with the unfused reference, and compare.

The model is built offline from a config with random weights (``--model-dir`` loads a local
transformers checkpoint instead); the data ships with the package (``kfused/data``). On a CPU
only the reference run happens (Triton needs a GPU; its CPU interpreter is far too slow to
train) and the report says so. Results: ``<out>/demo.json`` and ``<out>/loss_curve.png``.

    python -m kfused.cli.demo                          # CPU: a few minutes
    python -m kfused.cli.demo --method lora --steps 300 --compile
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
from typing import Dict, List, Optional

import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kfused demo",
        description="Fine-tune a GPT-2-shaped model with kfused adapters on the bundled "
                    "data-to-text set, fused kernels vs the unfused reference.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", default="krona",
                   help="adapter method (kfused.integration.methods()) e.g. krona, lora, krona_b")
    p.add_argument("--preset", default=None, help="a named preset instead of --method "
                   "(kfused.integration.PRESETS)")
    p.add_argument("--targets", default=None,
                   help="comma-separated roles/regexes (default: every linear layer, "
                        "qkv,o,ffn_in,ffn_out, for linear methods; the method's defaults "
                        "otherwise)")
    p.add_argument("--rank", type=int, default=8, help="rank r (LoRA-style methods)")
    p.add_argument("--scale", type=float, default=1.0, help="adapter scale s (KronA)")
    p.add_argument("--model-dir", default=None,
                   help="local transformers GPT-2 checkpoint directory (default: random weights)")
    p.add_argument("--layers", type=int, default=4, help="layers of the built model")
    p.add_argument("--d-model", type=int, default=128, help="width of the built model")
    p.add_argument("--heads", type=int, default=4, help="attention heads of the built model")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per example (bytes)")
    p.add_argument("--target-only", action="store_true",
                   help="loss on the sentence only (mask the meaning representation); use "
                        "--seq-len 256 so the sentences fit")
    p.add_argument("--batch-size", type=int, default=8, help="global batch size")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype (auto: bfloat16 on CUDA, float32 on the CPU); adapter "
                        "weights stay float32")
    p.add_argument("--runs", default="auto", choices=["auto", "both", "fused", "reference"],
                   help="auto: fused + reference on CUDA, reference only on the CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--distributed", default="none", choices=["none", "ddp", "fsdp2"],
                   help="multi-process training (launch with torchrun)")
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ------------------------------------------------------------------------------------------


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _build_model(args, vocab: int, device: torch.device):
    import transformers as tf

    if args.model_dir:
        model = tf.AutoModelForCausalLM.from_pretrained(args.model_dir)
        if model.get_input_embeddings().num_embeddings < vocab:
            model.resize_token_embeddings(vocab)
    else:
        from kfused.integration.models import tiny_model

        _seed(args.seed)
        model = tiny_model("gpt2", d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, vocab=vocab, max_len=max(args.seq_len, 64))
    return model.to(device)


def _adapter_config(args, backend: str):
    from kfused.integration import AdapterConfig, preset

    from kfused.integration import get_method

    targets = args.targets.split(",") if args.targets else None
    if targets is None and not args.preset and get_method(args.method).site == "linear":
        targets = ["qkv", "o", "ffn_in", "ffn_out"]
    if args.preset:
        cfg = preset(args.preset, backend=backend)
        return cfg.replace(targets=targets) if targets else cfg
    return AdapterConfig(method=args.method, targets=targets, r=args.rank, scale=args.scale,
                         backend=backend)


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


def train_run(name: str, backend: str, args, data: Dict[str, torch.Tensor],
              eval_data: Dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
              vocab: int, progress: bool) -> Dict[str, object]:
    """One fine-tuning run; returns its metrics and per-step losses."""
    from kfused.integration import use_backend

    # The environment default reaches adapter modules that take the backend per call.
    with use_backend(None if backend == "auto" else backend):
        return _train_run(name, backend, args, data, eval_data, device, dtype, vocab, progress)


def _train_run(name, backend, args, data, eval_data, device, dtype, vocab, progress):
    from kfused import distributed as kd
    from kfused.integration import count_parameters, inject

    model = _build_model(args, vocab, device)
    inject(model, _adapter_config(args, backend))
    trainable, total = count_parameters(model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model = kd.wrap_model(model, args.distributed, device,
                          **({"mp_dtype": dtype} if args.distributed == "fsdp2"
                             and dtype != torch.float32 else {}))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step_fn = model
    if args.compile:
        step_fn = torch.compile(model)
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

        bar = tqdm(total=args.steps, desc=f"{name:>9}", unit="step", leave=True)
    for step in range(args.steps):
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        batch = {k: v[idx] for k, v in data.items()}
        if args.distributed != "none":
            batch = kd.shard_batch(batch)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            loss = step_fn(**batch).loss
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        loss_val = float(kd.all_reduce_mean(loss.detach().float()).item())
        losses.append(loss_val)
        if step >= args.warmup:
            times.append(dt)
            tokens += int(batch["attention_mask"].numel()) * kd.world_size()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.4f}")
    if bar is not None:
        bar.close()
    model.eval()
    with torch.no_grad(), _autocast(device, dtype):
        ev = {k: v.to(device) for k, v in eval_data.items()}
        eval_loss = float(model(**ev).loss.float().item())
    mem = _peak_memory(device)
    step_ms = 1e3 * sum(times) / max(len(times), 1)
    result = {
        "name": name, "backend": backend, "steps": args.steps,
        "trainable_params": trainable, "total_params": total,
        "final_loss": losses[-1], "eval_loss": eval_loss,
        "mean_step_ms": step_ms,
        "tokens_per_s": tokens / sum(times) if times else float("nan"),
        **mem, "losses": losses,
    }
    result["_model"] = model
    return result


def _plot(runs: Dict[str, dict], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover
        return f"matplotlib unavailable ({exc})"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} ({r['backend']})",
                linestyle="-" if name == "fused" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _checkpoint_roundtrip(model, args, vocab, device, out_dir, eval_data, dtype):
    """save -> load into a fresh model -> compare; merge where the method allows."""
    from kfused.integration import (adapter_state_dict, get_method, get_state, is_mergeable,
                                    load, merge, save, unwrap)

    ckpt = os.path.join(out_dir, "adapter")
    save(model, ckpt)
    inner = unwrap(model)
    info: Dict[str, object] = {"checkpoint": ckpt}
    if args.distributed == "fsdp2":
        return info
    fresh = _build_model(args, vocab, device)
    load(fresh, ckpt)
    a, b = adapter_state_dict(inner), adapter_state_dict(fresh)
    info["reload_bit_exact"] = all(torch.equal(a[k], b[k]) for k in a)
    method = get_state(fresh).config.method
    if is_mergeable(method):
        fresh.eval()
        ev = {k: v.to(device) for k, v in eval_data.items()}
        with torch.no_grad():
            y0 = fresh(**ev).logits
            merge(fresh)
            y1 = fresh(**ev).logits
        info["merge_max_abs_logit_change"] = float((y1 - y0).abs().max().item())
    else:
        info["merge"] = f"not mergeable ({get_method(method).description})"
    return info


def run_demo(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``kfused demo``; returns the exit status."""
    args = build_parser().parse_args(argv)
    from kfused import distributed as kd
    from kfused.data import ByteTokenizer, encode_pairs, load_pairs

    if args.distributed != "none":
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

    runs_wanted = args.runs
    notes = []
    if runs_wanted == "auto":
        runs_wanted = "both" if device.type == "cuda" else "reference"
    plan = {"both": [("fused", "auto"), ("reference", "reference")],
            "fused": [("fused", "auto")], "reference": [("reference", "reference")]}[runs_wanted]
    if device.type != "cuda" and any(b == "auto" for _, b in plan):
        notes.append("fused run on the CPU uses the reference path (the fused kernels need a "
                     "CUDA GPU)")
    if device.type != "cuda" and args.runs == "auto":
        notes.append("CPU: running the unfused reference only; the fused run is skipped because "
                     "the Triton kernels need a CUDA GPU (their CPU interpreter is far too slow "
                     "to train)")

    try:  # a bad method / preset / target is a usage error, not a traceback
        _adapter_config(args, "reference")
    except (ValueError, NotImplementedError) as exc:
        print(f"kfused demo: {exc}", file=sys.stderr)
        return 2

    tok = ByteTokenizer()
    vocab = tok.vocab_size
    pairs = load_pairs()
    n_eval = min(64, len(pairs) // 10)
    data = encode_pairs(pairs[n_eval:], args.seq_len, tok, target_only=args.target_only)
    eval_data = encode_pairs(pairs[:n_eval], args.seq_len, tok, target_only=args.target_only)
    built = (f"from {args.model_dir}" if args.model_dir
             else f"{args.layers} layers, d={args.d_model}, random weights")
    say(f"kfused demo: {args.preset or args.method} adapters on a GPT-2-shaped model "
        f"({built}), "
        f"{len(pairs) - n_eval} train / {n_eval} eval examples, seq {args.seq_len}, "
        f"batch {args.batch_size}, {args.steps} steps, device {device}, "
        f"compute dtype {str(dtype).replace('torch.', '')}"
        + (f", {args.distributed} x {kd.world_size()}" if args.distributed != "none" else ""))
    for note in notes:
        say(f"note: {note}")

    results: Dict[str, dict] = {}
    roundtrip = {}
    t_start = time.perf_counter()
    for name, backend in plan:
        r = train_run(name, backend, args, data, eval_data, device, dtype, vocab,
                      progress=not args.no_progress)
        model = r.pop("_model")
        if (name, backend) == plan[-1]:
            os.makedirs(args.out, exist_ok=True) if main else None
            roundtrip = _checkpoint_roundtrip(model, args, vocab, device, args.out, eval_data,
                                              dtype)
        del model
        results[name] = r
    wall = time.perf_counter() - t_start

    report = {
        "device": str(device), "device_name": (torch.cuda.get_device_name(device)
                                                if device.type == "cuda" else platform.processor()
                                                or platform.machine()),
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
        "args": vars(args), "notes": notes, "wall_s": wall,
        "runs": {k: v for k, v in results.items()},
        "skipped": {"fused": notes[-1]} if "fused" not in results else {},
        "checkpoint": roundtrip,
    }
    if "fused" in results and "reference" in results:
        a, b = results["fused"]["losses"], results["reference"]["losses"]
        report["max_abs_loss_difference"] = max(abs(x - y) for x, y in zip(a, b))
        report["final_loss_difference"] = abs(a[-1] - b[-1])
    if main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "demo.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        err = _plot(results, os.path.join(args.out, "loss_curve.png"),
                    f"kfused demo: {args.preset or args.method}, GPT-2-shaped, {device.type}")
        print()
        print(f"{'run':<10} {'backend':<10} {'tokens/s':>10} {'step ms':>9} {'peak mem MiB':>13} "
              f"{'final loss':>11} {'eval loss':>10}")
        for name, r in results.items():
            print(f"{name:<10} {r['backend']:<10} {r['tokens_per_s']:>10.0f} "
                  f"{r['mean_step_ms']:>9.1f} "
                  f"{r['peak_memory_bytes'] / 2**20:>13.1f} {r['final_loss']:>11.4f} "
                  f"{r['eval_loss']:>10.4f}")
        if "fused" not in results:
            print(f"{'fused':<10} skipped: {notes[-1] if notes else 'not requested'}")
        if "max_abs_loss_difference" in report:
            print(f"largest |fused - reference| loss difference over {args.steps} steps: "
                  f"{report['max_abs_loss_difference']:.3e} (final step: "
                  f"{report['final_loss_difference']:.3e})")
        else:
            print("largest fused/reference loss difference: n/a (only one run)")
        first = next(iter(results.values()))
        print(f"trainable params: {first['trainable_params']:,d} of {first['total_params']:,d} "
              f"({100 * first['trainable_params'] / first['total_params']:.2f}%); "
              f"peak memory: {first['peak_memory_kind']}")
        if roundtrip:
            print(f"adapter checkpoint: {roundtrip.get('checkpoint')} "
                  + (f"(reload bit-exact: {roundtrip['reload_bit_exact']})"
                     if "reload_bit_exact" in roundtrip else "")
                  + ("; merge changes logits by at most "
                     f"{roundtrip['merge_max_abs_logit_change']:.2e}"
                     if "merge_max_abs_logit_change" in roundtrip
                     else (f"; {roundtrip['merge']}" if "merge" in roundtrip else "")))
        print(f"wrote {os.path.join(args.out, 'demo.json')}"
              + (f" and {os.path.join(args.out, 'loss_curve.png')}" if err is None
                 else f" (no plot: {err})") + f"; total {wall:.1f} s")
    if args.distributed != "none":
        kd.cleanup()
    return 0


def main() -> None:  # pragma: no cover
    sys.exit(run_demo())


if __name__ == "__main__":  # pragma: no cover
    main()
