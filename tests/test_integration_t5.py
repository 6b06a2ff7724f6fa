"""T5 through the attention-site methods.

Kernel-wise / Kernel-wise-lite / Kernel-mix / Kernel-mix-lite: injected into a tiny T5 whose
head width d_kv is not d_model / n_heads (inner width H·d_kv = 48 vs d_model = 32), into the
encoder self-attention, decoder self-attention and decoder cross-attention (EncDecAttention;
there q's Kernel-wise-lite part is left out, see ``kfused.integration.headwise``);
train / save / load / merge / unmerge and fused vs reference outputs under docs/math.md §4.

Inducer family: T5's relative position bias is not an input of the inducer kernel, so every
inducer/prefix method is refused with a ValueError before the model is changed.
"""

import copy

import pytest
import torch

from kfused.integration import (AdapterConfig, get_state, inject, is_mergeable, load, merge,
                                save, unmerge, use_backend)
from kfused.testing import assert_against_reference

from _hf_helpers import batch, embeds_forward, make, train_steps


D_KV = 12  # 4 heads of width 12: inner width 48 != d_model 32

HEADWISE = {
    "kernel_wise": dict(method="kernel_wise", targets=["q", "v", "o"], r=2),
    "kernel_wise_lite": dict(method="kernel_wise_lite", r=2),
    "kernel_mix": dict(method="kernel_mix", targets=["q", "v", "o"],
                       ranks={"q": (3, 4), "v": (2, 2), "o": (2, 2)}, options={"lite": ["v"]}),
    "kernel_mix_lite": dict(method="kernel_mix_lite", ranks={"q": (1, 1), "v": (2, 1)}),
}


def t5(**kw):
    kw.setdefault("d_kv", D_KV)
    return make("t5", **kw)


def _attention_modules(model):
    return {n: m for n, m in model.named_modules()
            if n.endswith(("SelfAttention", "EncDecAttention"))}


@pytest.mark.parametrize("name", list(HEADWISE))
def test_t5_headwise_end_to_end(name, tmp_path):
    from kfused.modules.headwise import HeadwiseOutput, HeadwiseProjection

    cfg = HEADWISE[name]
    model = t5()
    inject(model, AdapterConfig(backend="reference", **cfg))
    state = get_state(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(state.param_names)

    # every attention (2 encoder self, 2 decoder self, 2 cross) is adapted
    attns = _attention_modules(model)
    assert len(attns) == 6
    lite = name.endswith("lite") or "v" in cfg.get("options", {}).get("lite", [])
    for aname, attn in attns.items():
        cross = aname.endswith("EncDecAttention")
        assert isinstance(attn.v, HeadwiseProjection)
        assert attn.v.head_dim == D_KV and attn.v.n_heads == 4
        if name == "kernel_wise_lite" and cross:
            assert isinstance(attn.q, torch.nn.Linear)  # q-lite is not defined in cross-attn
        else:
            assert isinstance(attn.q, HeadwiseProjection)
            q_ranks = attn.q.adapter.ranks
            assert q_ranks.lite == (0 if cross or not name.endswith("lite") else
                                    cfg.get("r") or cfg["ranks"]["q"][0])
        if lite:  # v-lite reads K = (v's input) W_k: the cross-attention's real keys
            assert attn.v.adapter.ranks.lite > 0 and attn.v.key is attn.k
        assert isinstance(attn.o, HeadwiseOutput) == ("o" in cfg.get("targets", []))

    with use_backend("reference"):
        losses = train_steps(model, "t5", steps=4, lr=2e-2)
        assert losses[-1] < losses[0], losses
        save(model, str(tmp_path / "c"))
        fresh = t5()
        load(fresh, str(tmp_path / "c"))
        model.eval(), fresh.eval()
        inputs = batch("t5")
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, fresh(**inputs).logits)

    assert is_mergeable(name)
    double = t5().double()
    inject(double, AdapterConfig(backend="reference", adapter_dtype="float64", init="paper",
                                 **cfg))
    double.eval()
    plain = t5().double().eval()
    with torch.no_grad(), use_backend("reference"):
        y_plain = plain(**inputs).logits
        y0 = double(**inputs).logits
        assert (y0 - y_plain).abs().max() > 1e-6  # the update is not a no-op
        merge(double)
        torch.testing.assert_close(double(**inputs).logits, y0, rtol=1e-10, atol=1e-10)
        unmerge(double)
        torch.testing.assert_close(double(**inputs).logits, y0, rtol=1e-10, atol=1e-10)
        base_w = dict(plain.named_parameters())
        for n, p in double.named_parameters():  # unmerge restores the frozen weights
            key = n.replace(".base.", ".")
            if key in base_w and not p.requires_grad:
                torch.testing.assert_close(p, base_w[key], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(HEADWISE))
def test_t5_headwise_fused_matches_reference_spec4(name, device):
    base = t5(n_layers=1)
    inject(base, AdapterConfig(init="paper", adapter_dtype=None, **HEADWISE[name]))
    copies = {}

    def run(emb, backend):
        key = (emb.dtype, backend)
        if key not in copies:
            copies[key] = copy.deepcopy(base).to(device=emb.device, dtype=emb.dtype).eval()
        with use_backend(backend):
            return embeds_forward(copies[key], "t5", emb)

    emb = torch.randn(2, 7, 32, dtype=torch.float64)
    assert_against_reference(lambda emb: run(emb, "triton"), lambda emb: run(emb, "reference"),
                             {"emb": emb}, torch.float32, device)


def test_t5_headwise_triton_parameter_gradients(device):
    """The adapters' own gradients from the fused backward agree with the reference."""
    base = t5(n_layers=1)
    inject(base, AdapterConfig(init="paper", **HEADWISE["kernel_mix"]))
    inputs = {k: v.to(device) for k, v in batch("t5", n=7).items()}
    grads = {}
    for backend in ("reference", "triton"):
        m = copy.deepcopy(base).to(device).eval()
        with use_backend(backend):
            m(**inputs).loss.backward()
        grads[backend] = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert grads["triton"].keys() == grads["reference"].keys() and grads["triton"]
    for n, g in grads["reference"].items():
        gt = grads["triton"][n]
        assert gt is not None and torch.isfinite(gt).all(), n
        assert (gt - g).norm() <= 1e-4 * g.norm() + 1e-6, (n, (gt - g).norm(), g.norm())


INDUCER_FAMILY = {
    "inducer": dict(method="inducer", r=4),
    "prefix": dict(method="prefix", r=5),
    "inducer_lora": dict(method="inducer_lora", r=4),
    "mam_inducer": dict(method="mam_inducer", r=4),
    "mam": dict(method="mam", r=4),
}


@pytest.mark.parametrize("name", list(INDUCER_FAMILY))
def test_t5_inducer_family_refused(name):
    model = t5(n_layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match="T5's relative position bias is not supported by the "
                                         "inducer kernel"):
        inject(model, AdapterConfig(**INDUCER_FAMILY[name]))
    # refused before anything changed (composites: the LoRA / FFN parts were not applied)
    assert get_state(model, required=False) is None
    assert model.config._attn_implementation == impl
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters())


def test_t5_add_inducers_refused():
    from kfused.integration.hf_attention import add_inducers, unsupported_reason

    model = t5(n_layers=1)
    assert "relative position bias" in unsupported_reason(model)
    assert unsupported_reason(make("llama", n_layers=1)) is None
    impl = model.config._attn_implementation
    with pytest.raises(ValueError, match="relative position bias"):
        add_inducers(model, key_bottleneck=2, value_bottleneck=2)
    with pytest.raises(ValueError, match="relative position bias"):
        add_inducers(model.encoder, prefix_len=2, inducer=False)  # a submodule is caught too
    assert model.config._attn_implementation == impl
