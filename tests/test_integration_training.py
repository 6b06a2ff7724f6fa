"""Issue 5, item 5: torch.compile without graph breaks, autocast with float32 adapters,
gradient checkpointing and the transformers Trainer (the `kfused demo` tests are in
tests/test_demo.py)."""

import os

import pytest
import torch

from kfused.integration import AdapterConfig, get_state, inject

from _hf_helpers import batch, make


def _adapter_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("arch,method,backend", [("gpt2", "krona", "triton"),
                                                 ("llama", "lora", "reference")])
def test_torch_compile_fullgraph(arch, method, backend, device):
    # HF computes the loss with a graph break of its own (also without adapters), so the
    # compiled region is the model's forward to the logits; fullgraph=True fails on any break.
    torch._dynamo.reset()
    model = make(arch, n_layers=1)
    inject(model, AdapterConfig(method=method, init="random", backend=backend))
    model.to(device)            # (compiled Triton takes CUDA tensors only)
    inputs = batch(arch)
    ids = inputs["input_ids"].to(device)

    def logits(m):
        return m(input_ids=ids).logits

    ref = logits(model)
    ref.square().mean().backward()
    want = _adapter_grads(model)
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = logits(compiled)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    got = _adapter_grads(model)
    assert got.keys() == want.keys() and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_keeps_float32_adapters(dtype):
    if dtype == torch.float16 and not hasattr(torch, "autocast"):
        pytest.skip("no autocast")
    model = make("gpt2")
    inject(model, AdapterConfig(method="krona", init="random", backend="reference"))
    inputs = batch("gpt2")
    loss32 = model(**inputs).loss
    with torch.autocast("cpu", dtype=dtype):
        loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - loss32.item()) < 0.05
    for n in get_state(model).param_names:
        p = model.get_parameter(n)
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    model = make("gpt2")
    inject(model, AdapterConfig(method="krona_b", init="random", backend="reference"))
    inputs = batch("gpt2")
    model.train()
    model(**inputs).loss.backward()
    want = _adapter_grads(model)
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:  # frozen embeddings: the checkpointed blocks need an input that wants grad
        model.enable_input_require_grads()
    model(**inputs).loss.backward()
    got = _adapter_grads(model)
    assert got.keys() == want.keys() and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", [
    dict(method="krona", targets=["q", "v", "o"]),
    # the "add" inducer's adapter is reachable under two names (the attention layer's
    # kfused_inducer and its output projection's adapter): the Trainer's checkpoint save
    # (save_pretrained, safetensors) refused the shared tensors
    dict(method="inducer", r=2, init="paper")], ids=["krona", "inducer"])
def test_transformers_trainer(tmp_path, config):
    from transformers import Trainer, TrainingArguments

    model = make("llama")
    inject(model, AdapterConfig(backend="reference", **config))
    rows = [{k: v[0] for k, v in batch("llama", b=1, seed=s).items()} for s in range(4)]
    from kfused.integration import adapter_state_dict, load
    from kfused.integration.hf_trainer import AdapterCheckpointCallback

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4,
                             learning_rate=2e-2, logging_steps=1, report_to=[],
                             save_strategy="steps", save_steps=8, use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0,
                             lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      callbacks=[AdapterCheckpointCallback()])
    trainer.train()
    fresh = make("llama")
    load(fresh, str(tmp_path / "checkpoint-8" / "kfused_adapter"))
    want = adapter_state_dict(model)
    assert all(torch.equal(v, want[k]) for k, v in adapter_state_dict(fresh).items())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert all(not p.requires_grad for n, p in model.named_parameters()
               if n not in set(get_state(model).param_names))


def test_trainer_hyperparameter_search_keeps_each_trials_adapters(tmp_path, monkeypatch):
    """During a hyperparameter search the Trainer writes <output_dir>/run-<n>/checkpoint-<s>;
    the callback wrote every trial's adapters to <output_dir>/checkpoint-<s>/kfused_adapter,
    each trial replacing the last and none beside its own checkpoint. (The search backend is
    stood in for: optuna is not a dependency; the Trainer is told a trial as it would be.)"""
    import types

    import transformers.integrations
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import HPSearchBackend

    from kfused.integration import adapter_state_dict, load
    from kfused.integration.hf_trainer import AdapterCheckpointCallback

    monkeypatch.setattr(transformers.integrations, "hp_params", lambda trial: {})
    rows = [{k: v[0] for k, v in batch("llama", b=1, seed=s).items()} for s in range(2)]
    states = []
    for n in range(2):
        model = make("llama", seed=n)
        inject(model, AdapterConfig(method="lora", backend="reference", init="random"))
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=1,
                                 per_device_train_batch_size=2, report_to=[],
                                 save_strategy="steps", save_steps=1, use_cpu=True,
                                 disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          callbacks=[AdapterCheckpointCallback()])
        trainer.hp_search_backend, trainer.hp_space = HPSearchBackend.OPTUNA, lambda t: {}
        trainer.train(trial=types.SimpleNamespace(number=n, params={}))
        states.append(adapter_state_dict(model))
    assert not (tmp_path / "checkpoint-1").exists()
    for n, want in enumerate(states):
        fresh = make("llama")
        load(fresh, str(tmp_path / f"run-{n}" / "checkpoint-1" / "kfused_adapter"))
        assert all(torch.equal(v, want[k]) for k, v in adapter_state_dict(fresh).items())


def test_bench_e2e_cases_cpu(monkeypatch):
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)
    import kfused.cases.e2e as be
    from kfused.bench import measure

    full = be.bench_cases("cpu", torch.bfloat16)
    assert [c.shape["model"] for c in full] == ["gpt2-small", "llama-1b-width"]
    assert full[0].shape["seq"] == 512 and full[0].shape["batch"] == 8
    names = [p.name for p in full[0].providers]
    for want in ["peft-lora", "peft-lokr", "peft-prefix", "kfused-krona-fused",
                 "kfused-krona-unfused", "kfused-kernel-mix-qvo-fused",
                 "kfused-inducer-lora-unfused", "kfused-mam-inducer-fused"]:
        assert want in names
    fused = {p.name: p for p in full[0].providers}["kfused-krona-fused"]
    assert "CUDA" in fused.skip_reason
    # run two providers for real on a shrunken model
    tiny = {"gpt2-small": dict(arch="gpt2", layers=1, d=32, heads=2, ff=64, vocab=64, seq=16,
                               batch=2)}
    monkeypatch.setattr(be, "_model_specs", lambda quick: tiny)
    case = be.bench_cases("cpu", torch.float32, quick=True)[0]
    case.providers = [p for p in case.providers
                      if p.name in ("peft-lora", "kfused-krona-unfused")]
    rows = measure(case, "cpu", rep_ms=20, warmup_ms=5, modes=("fwd",))
    assert all("ms_p50" in r for r in rows), rows
    del sys.modules["kfused.cases.e2e"]


def test_krona_fused_runs_in_autocast_dtype(device):
    # The custom ops are opaque to autocast: the module casts the activation itself, so the
    # fused kernel runs in half precision like the linear layer autocast would have produced.
    from torch import nn

    from kfused.modules.krona import KronALinear

    m = KronALinear(nn.Linear(16, 24, device=device), init="random", backend="triton")
    x = torch.randn(5, 16, device=device)
    with torch.autocast(device, dtype=torch.float16):
        y = m(x)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert m.A.grad.dtype == torch.float32
    m.backend = "reference"
    with torch.autocast(device, dtype=torch.float16):
        y_ref = m(x)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
