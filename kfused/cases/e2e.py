"""End-to-end benchmark cases: one training step (forward + backward + AdamW step)
of GPT-2 small (seq 512, batch 8) and of a Llama-style 1B-width model, bf16 autocast with
float32 adapters, for

    peft-lora, peft-lokr, peft-prefix                        (PEFT, as practitioners use it)
    kfused-krona, kfused-kernel-mix-qvo, kfused-inducer-lora, kfused-mam-inducer
                                                             (each fused and unfused)
    frozen-floor                                             (no adapter: forward + backward
                                                              to the embedding output, the
                                                              cost floor)

``bench_cases(device, dtype, quick=False)`` returns :class:`kfused.bench.BenchCase` lists for
the shared harness; each provider's ``fn()`` runs a whole training step and returns the detached
loss, so the harness's "fwd" mode times the full step. ``shape["tokens"]`` gives tokens/s.
Standalone: ``python benchmarks/bench_e2e.py [--quick] [--out benchmarks/results/local]`` writes
``e2e_<device>.json`` (``e2e_<device>-2.json``, ... when that name is taken: never over a
file), prints one table and draws the ``.png`` beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable, Dict, List, Optional

import torch

from kfused._files import new_results_file, write_new
from kfused.bench import BenchCase, Provider, measure

# (label, AdapterConfig kwargs) of the kfused providers; each runs fused and unfused.
KFUSED_METHODS = {
    "krona": dict(method="krona"),
    "kernel-mix-qvo": dict(preset="kernel-mix-qvo-intermediate"),
    "inducer-lora": dict(preset="inducer-lora"),
    "mam-inducer": dict(preset="mam-inducer"),
}


def _model_specs(quick: bool) -> Dict[str, dict]:
    if quick:
        return {
            "gpt2-small": dict(arch="gpt2", layers=2, d=768, heads=12, ff=3072, vocab=50257,
                               seq=128, batch=2),
            "llama-1b-width": dict(arch="llama", layers=2, d=2048, heads=32, kv=4, ff=5632,
                                   vocab=32000, seq=128, batch=2),
        }
    return {
        "gpt2-small": dict(arch="gpt2", layers=12, d=768, heads=12, ff=3072, vocab=50257,
                           seq=512, batch=8),
        # TinyLlama-1.1B's shape (22 layers, d 2048, 32 heads, 4 KV heads, FFN 5632).
        "llama-1b-width": dict(arch="llama", layers=22, d=2048, heads=32, kv=4, ff=5632,
                               vocab=32000, seq=512, batch=8),
    }


def _cpu_quick_specs() -> Dict[str, dict]:
    """``--quick`` on a CPU: the same two model families, shrunk so that every provider's
    training step takes milliseconds (the GPU sizes take minutes per step on a CPU)."""
    return {
        "gpt2-tiny": dict(arch="gpt2", layers=2, d=64, heads=4, ff=256, vocab=512, seq=64,
                          batch=2),
        "llama-tiny": dict(arch="llama", layers=2, d=64, heads=4, kv=2, ff=176, vocab=512,
                           seq=64, batch=2),
    }


def _build(spec: dict, device, dtype):
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a 1B model inits slowly on a CPU
        model = _build_on_device(spec, tf)
    return model.to(dtype=dtype)


def _build_on_device(spec: dict, tf):
    if spec["arch"] == "gpt2":
        cfg = tf.GPT2Config(n_embd=spec["d"], n_layer=spec["layers"], n_head=spec["heads"],
                            n_inner=spec["ff"], vocab_size=spec["vocab"],
                            n_positions=max(1024, spec["seq"]), resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    else:
        cfg = tf.LlamaConfig(hidden_size=spec["d"], intermediate_size=spec["ff"],
                             num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                             num_key_value_heads=spec["kv"], vocab_size=spec["vocab"],
                             max_position_embeddings=max(2048, spec["seq"]))
        model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    return model


def _targets(arch: str, kind: str) -> List[str]:
    return {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}[arch]


def _peft_model(model, arch: str, which: str):
    import peft

    if which == "lora":
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=_targets(arch, which),
                              task_type="CAUSAL_LM")
    elif which == "lokr":
        cfg = peft.LoKrConfig(r=8, alpha=8, target_modules=_targets(arch, which),
                              task_type="CAUSAL_LM")
    elif which == "prefix":
        cfg = peft.PrefixTuningConfig(num_virtual_tokens=30, task_type="CAUSAL_LM")
    else:
        raise ValueError(which)
    return peft.get_peft_model(model, cfg)


def _kfused_model(model, label: str, backend: str):
    from kfused.integration import AdapterConfig, inject, preset

    kw = dict(KFUSED_METHODS[label])
    if "preset" in kw:
        cfg = preset(kw.pop("preset"), backend=backend, **kw)
    else:
        cfg = AdapterConfig(backend=backend, **kw)
    return inject(model, cfg)


def _method_missing(label: str) -> Optional[str]:
    from kfused.integration import get_method, preset
    from kfused.integration.registry import methods

    kw = KFUSED_METHODS[label]
    name = preset(kw["preset"]).method if "preset" in kw else kw["method"]
    spec = methods()[name]
    parts = [p for p, _ in spec.parts] if spec.site == "composite" else [name]
    for p in parts:
        try:
            get_method(p)
        except NotImplementedError as exc:
            return f"method {p!r} not installed: {str(exc).split(':')[0]}"
    return None


def _step_fn(model, inputs: dict, device: torch.device, dtype: torch.dtype,
             backend: Optional[str] = None) -> Callable:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4) if params else None
    def amp():
        return (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())

    model.train()

    from kfused.integration import use_backend

    def step():
        # the harness times "fwd" under no_grad: a training step needs grad. use_backend sets
        # the default for adapter modules that take the backend per call (headwise, inducer).
        with torch.enable_grad(), use_backend(backend):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            with amp():
                loss = model(**inputs).loss
            loss.backward()
            if opt is not None:
                opt.step()
        return loss.detach()

    return step


def _provider(name: str, spec: dict, device, dtype, attach: Callable,
              skip: Optional[str] = None, backend: Optional[str] = None) -> Provider:
    def make():
        model = _build(spec, device, dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        model = attach(model)
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
        ids = ids.to(device)
        inputs = {"input_ids": ids, "labels": ids}
        return _step_fn(model, inputs, device, dtype, backend), []

    return Provider(name, make, skip_reason=skip)


def _floor(model):
    # No adapter: backward still runs through every layer to the embedding output (as it
    # does for every method), with no weight gradient and no optimizer work.
    model.enable_input_require_grads()
    return model


def bench_cases(device, dtype=torch.bfloat16, quick: bool = False) -> List[BenchCase]:
    """One BenchCase per model; providers as in the module docstring."""
    device = torch.device(device)
    try:
        import peft  # noqa: F401

        peft_skip = None
    except ImportError as exc:
        peft_skip = f"peft not installed ({exc})"
    fused_skip = None if device.type == "cuda" else "fused kernels need a CUDA device"
    specs = _model_specs(quick)
    if quick and device.type != "cuda":
        # CPU: tiny models in float32 (bfloat16 autocast on a CPU is slow and not what a
        # CPU user runs); the GPU-sized cases stay for `bench_cases(...)` without quick
        specs, dtype = _cpu_quick_specs(), torch.float32
    out = []
    for model_name, spec in specs.items():
        tokens = spec["batch"] * spec["seq"]
        provs = [_provider("frozen-floor", spec, device, dtype, _floor)]
        for which in ("lora", "lokr", "prefix"):
            skip = peft_skip
            if which == "lokr" and spec["arch"] == "gpt2" and not skip:
                skip = "PEFT LoKr does not support transformers Conv1D (GPT-2's c_attn)"
            provs.append(_provider(f"peft-{which}", spec, device, dtype,
                                   lambda m, w=which, a=spec["arch"]: _peft_model(m, a, w),
                                   skip=skip))
        for label in KFUSED_METHODS:
            missing = _method_missing(label)
            for variant, backend in (("fused", "auto"), ("unfused", "reference")):
                skip = missing or (fused_skip if variant == "fused" else None)
                provs.append(_provider(f"kfused-{label}-{variant}", spec, device, dtype,
                                       lambda m, lb=label, be=backend: _kfused_model(m, lb, be),
                                       skip=skip,
                                       backend="reference" if variant == "unfused" else None))
        out.append(BenchCase(op="e2e_train_step",
                             shape={"model": model_name, "layers": spec["layers"],
                                    "d_model": spec["d"], "seq": spec["seq"],
                                    "batch": spec["batch"], "tokens": tokens},
                             dtype=dtype, providers=provs))
    return out


# ------------------------------------------------------------------------------------------
# standalone run: table + JSON + plot


def run(device: str, dtype: torch.dtype, quick: bool, out_dir: str, rep_ms: float) -> List[dict]:
    rows = []
    cases = bench_cases(device, dtype, quick)
    for case in cases:
        for row in measure(case, device, rep_ms=rep_ms, warmup_ms=rep_ms / 4, modes=("fwd",)):
            if "ms_p50" in row:
                row["mode"] = "train_step"
                row["tokens_per_s"] = case.shape["tokens"] / (row["ms_p50"] * 1e-3)
            rows.append(row)
    os.makedirs(out_dir, exist_ok=True)
    tag = torch.device(device).type
    # the dtype the cases ran (the CPU's quick cases are float32 whatever was asked)
    ran = sorted({str(c.dtype) for c in cases}) or [str(dtype)]
    meta = {"device": torch.cuda.get_device_name() if tag == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": ", ".join(ran),
            "requested_dtype": str(dtype), "quick": quick}
    # a new file per run (e2e_<device>-2.json, ...): never over a file kfused did not write
    path = new_results_file(out_dir, f"e2e_{tag}", json.dumps({"meta": meta, "rows": rows},
                                                               indent=2))
    print(f"wrote {path}")
    print(f"{'model':<15} {'provider':<30} {'tokens/s':>10} {'step ms':>9} {'peak MiB':>9}")
    for r in rows:
        m = r["shape"]["model"]
        if "ms_p50" in r:
            mem = r.get("peak_mem_bytes")
            print(f"{m:<15} {r['provider']:<30} {r['tokens_per_s']:>10.0f} {r['ms_p50']:>9.2f} "
                  f"{(mem / 2**20 if mem else float('nan')):>9.0f}")
        else:
            print(f"{m:<15} {r['provider']:<30} {'-':>10} {'':>9} {'':>9}  "
                  f"{r.get('skipped') or r.get('error', '')[:80]}")
    _plot(rows, str(path.with_suffix(".png")))
    return rows


def _plot(rows: List[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    done = [r for r in rows if "ms_p50" in r]
    models = sorted({r["shape"]["model"] for r in done})
    if not done:
        return
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.5 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        rs = [r for r in done if r["shape"]["model"] == m]
        names = [r["provider"] for r in rs]
        axes[i][0].barh(names, [r["tokens_per_s"] for r in rs])
        axes[i][0].set_title(f"{m}: tokens/s (one training step)")
        mem = [(r.get("peak_mem_bytes") or 0) / 2**20 for r in rs]
        axes[i][1].barh(names, mem, color="tab:orange")
        axes[i][1].set_title(f"{m}: peak memory (MiB)")
    fig.tight_layout()
    # a new file only: one that appeared at that name during the run is not replaced
    if not write_new(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png")):
        print(f"bench e2e: {path} appeared during the run; not replacing it (no plot)")
    plt.close(fig)
