"""Issue 5, items 1, 2 and 8: inject / train / save / load / merge on tiny GPT-2, Llama, RoBERTa
and T5 models built offline, and fused vs reference model outputs under the docs/math.md §4 rule."""

import copy
import json
import os

import pytest
import torch
from torch import nn

from kfused.integration import (AdapterConfig, CheckpointError, adapter_state_dict, get_state,
                                inject, load, merge, methods, preset, print_trainable_parameters,
                                read_checkpoint_config,
                                register_method, save, set_backend, unmerge)
from kfused.modules.krona import KronALinear
from kfused.modules.lora import LoRALinear
from kfused.testing import assert_against_reference

from _hf_helpers import ARCHS, batch, embeds_forward, make, train_steps

METHODS = ["lora", "krona", "krona_b", "krona_b_res", "parallel_adapter"]
MERGEABLE = {"lora", "krona"}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_inject_train_save_load(arch, method, tmp_path):
    model = make(arch)
    n_before = sum(p.numel() for p in model.parameters())
    inject(model, AdapterConfig(method=method, backend="reference"))
    state = get_state(model)
    assert state.adapter_modules and state.param_names
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(state.param_names)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == n_before

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses = train_steps(model, arch, steps=6)
    assert losses[-1] < losses[0], losses
    for n, p in model.named_parameters():  # the base never moves
        if n in frozen:
            assert torch.equal(p, frozen[n]), n

    save(model, str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind
    fresh = make(arch)  # same seed: same frozen base
    load(fresh, str(tmp_path / "ckpt"))
    a, b = adapter_state_dict(model), adapter_state_dict(fresh)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    model.eval(), fresh.eval()
    inputs = batch(arch)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, fresh(**inputs).logits)
    assert {n for n, p in fresh.named_parameters() if p.requires_grad} == trainable


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_merge_float64(arch, method):
    model = make(arch).double()
    inject(model, AdapterConfig(method=method, init="random", adapter_dtype="float64",
                                backend="reference"))
    model.eval()
    inputs = batch(arch)
    if method not in MERGEABLE:
        with pytest.raises(ValueError, match=f"cannot merge method '{method}'"):
            merge(model)
        return
    base_w = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        y0 = model(**inputs).logits
        merge(model)
        y1 = model(**inputs).logits
        assert all(m.merged for m in (mm for mm in model.modules()
                                      if isinstance(mm, (KronALinear, LoRALinear))))
        unmerge(model)
        y2 = model(**inputs).logits
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y2, y0, rtol=1e-10, atol=1e-10)
    for n, p in model.named_parameters():
        if n in base_w:
            torch.testing.assert_close(p, base_w[n], rtol=0, atol=1e-12)


# Fused (Triton; the CPU interpreter here) vs reference model outputs and input gradients, docs/math.md §4.
FUSED_CASES = [(a, "krona") for a in ARCHS] + [("gpt2", "krona_b"), ("llama", "krona_b_res")]


@pytest.mark.parametrize("arch,method", FUSED_CASES)
def test_fused_matches_reference_spec4(arch, method, device):
    base = make(arch, d_model=32, n_layers=1)
    inject(base, AdapterConfig(method=method, init="random", adapter_dtype=None))
    models = {}

    def model_for(dtype, dev, backend):
        key = (dtype, str(dev), backend)
        if key not in models:
            m = copy.deepcopy(base).to(device=dev, dtype=dtype).eval()
            set_backend(m, backend)
            models[key] = m
        return models[key]

    def ref_fn(emb):
        return embeds_forward(model_for(emb.dtype, emb.device, "reference"), arch, emb)

    def kernel_fn(emb):
        return embeds_forward(model_for(emb.dtype, emb.device, "triton"), arch, emb)

    emb = torch.randn(2, 9, 32, dtype=torch.float64)
    assert_against_reference(kernel_fn, ref_fn, {"emb": emb}, torch.float32, device)


# ------------------------------------------------------------------------------------------
# checkpoints: errors, partial writes, corruption


def _trained(arch="gpt2", method="krona", **kw):
    m = make(arch, **kw)
    inject(m, AdapterConfig(method=method, init="random", backend="reference"))
    return m


def test_load_wrong_architecture(tmp_path):
    save(_trained("gpt2"), str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*model_type 'gpt2'.*llama"):
        load(make("llama"), str(tmp_path / "c"))


def test_load_wrong_shapes(tmp_path):
    save(_trained("gpt2", d_model=32), str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match="shape mismatch|cannot inject"):
        load(make("gpt2", d_model=48), str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match="missing in checkpoint"):
        load(make("gpt2", n_layers=3), str(tmp_path / "c"))


def test_load_wrong_method(tmp_path):
    save(_trained("gpt2", "krona"), str(tmp_path / "c"))
    other = make("gpt2")
    inject(other, method="lora")
    with pytest.raises(CheckpointError, match="method 'krona'"):
        load(other, str(tmp_path / "c"))


# (kills during save, partial and corrupt checkpoints, foreign files: tests/test_checkpoint.py)


def test_checkpoint_json_contents(tmp_path):
    save(_trained("llama"), str(tmp_path / "c"))
    meta = read_checkpoint_config(str(tmp_path / "c"))
    assert meta["config"]["method"] == "krona"
    assert meta["base"]["model_type"] == "llama" and meta["base"]["d_model"] == 32
    assert meta["kfused_version"]
    assert all("shape" in v for v in meta["tensors"].values())


# ------------------------------------------------------------------------------------------
# config, targets, registry


def test_targets_roles_regex_ranks():
    m = make("llama")
    inject(m, AdapterConfig(method="lora", targets=["q", r".*\.mlp\.down_proj"],
                            ranks={"q": 2, "ffn_out": 3}))
    mods = get_state(m).adapter_modules
    assert len(mods) == 4
    assert m.model.layers[0].self_attn.q_proj.r == 2
    assert m.model.layers[0].mlp.down_proj.r == 3
    assert not isinstance(m.model.layers[0].self_attn.v_proj, LoRALinear)


def test_gpt2_qv_maps_to_fused_c_attn():
    m = make("gpt2")
    inject(m, method="krona")
    assert get_state(m).adapter_modules == ["transformer.h.0.attn.c_attn",
                                            "transformer.h.1.attn.c_attn"]
    assert m.transformer.h[0].attn.c_attn.A.shape == (8, 4)  # 96 = 8 * 12, 32 = 4 * 8


def test_bad_configs():
    with pytest.raises(ValueError, match="unknown adapter method 'loraa'"):
        inject(make("gpt2"), method="loraa")
    with pytest.raises(ValueError, match="no module of this model matched"):
        inject(make("gpt2"), method="lora", targets=["nonexistent_proj"])
    with pytest.raises(ValueError, match="adapts linear layers.*GPT2MLP"):
        inject(make("gpt2"), method="lora", targets=["ffn"])
    m = make("gpt2")
    inject(m, method="lora")
    with pytest.raises(ValueError, match="already has kfused adapters"):
        inject(m, method="krona")
    with pytest.raises(ValueError, match="unknown preset"):
        preset("lora-9000")
    with pytest.raises(ValueError, match="no kfused adapters"):
        merge(make("gpt2"))


def test_paper_methods_registered():
    # Every paper method is registered with its implementation (none is only declared).
    for name in ["kernel_mix", "kernel_wise_lite", "inducer", "prefix", "inducer_lora", "mam"]:
        assert name in methods()
        spec = methods()[name]
        if spec.site != "composite":
            assert spec.wrap is not None
            continue
        inject(make("gpt2"), method=name)


def test_presets():
    m = make("gpt2")
    inject(m, "lora-e2e")
    assert m.transformer.h[0].attn.c_attn.scale == 8.0  # alpha 32 / r 4
    cfg = preset("krona_b-glue")
    assert cfg.a_shape == (32, 24) and cfg.scale == 16.0
    assert AdapterConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("method,scale,bias", [
    ("krona_b", 16.0, True), ("krona_b", 0.5, False), ("krona_b_res", 2.0, True),
    ("parallel_adapter", 2.0, False), ("parallel_adapter", 1.0, False)])
def test_block_methods_take_scale_and_bias_from_the_config(method, scale, bias):
    # The block methods' wraps pass AdapterConfig.scale and .bias on to their modules: a wrap
    # that dropped them left the module's own defaults (KronA^B without its output bias, the
    # parallel adapter at its 4.0) and nothing noticed, since the modules then still train.
    from kfused.modules.krona import KronABlock
    from kfused.modules.parallel_adapter import ScaledParallelAdapter

    model = make("llama")
    inject(model, AdapterConfig(method=method, scale=scale, bias=bias, init="random",
                                backend="reference"))
    kind = ScaledParallelAdapter if method == "parallel_adapter" else KronABlock
    mods = [m for m in model.modules() if isinstance(m, kind)]
    assert mods
    for m in mods:
        assert m.scale == scale
        if kind is KronABlock:
            assert (m.bias is not None) == bias
            assert (m.res_scale is not None) == (method == "krona_b_res")


class _Scaled(nn.Module):  # a toy third-party method: y = base(x) * (1 + g)
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.g = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.base(x) * (1 + self.g)


def test_register_method_extension_point(tmp_path):
    register_method("toy_gate", site="linear", wrap=lambda mod, t, cfg: _Scaled(mod),
                    default_targets={"*": ["o"]}, description="toy")
    register_method("toy_gate_lora", site="composite",
                    parts=[("lora", ["q", "v"]), ("toy_gate", None)])
    m = make("llama")
    inject(m, method="toy_gate_lora", options={"lora": {"r": 2}})
    names = get_state(m).param_names
    assert any(n.endswith("o_proj.g") for n in names) and any(n.endswith("q_proj.A") for n in names)
    assert m.model.layers[0].self_attn.q_proj.r == 2
    assert train_steps(m, "llama", steps=4)[-1] < train_steps(m, "llama", steps=1)[0] + 1
    save(m, str(tmp_path / "c"))
    fresh = make("llama")
    load(fresh, str(tmp_path / "c"))
    with pytest.raises(ValueError, match="cannot merge method 'toy_gate_lora'"):
        merge(fresh)


def test_print_trainable_parameters(capsys):
    m = make("roberta")
    inject(m, method="lora", r=4)
    t, total = print_trainable_parameters(m)
    out = capsys.readouterr().out
    assert f"trainable params: {t:,d}" in out and "trainable%" in out
    assert t == 2 * 2 * (4 * 32 + 32 * 4)  # 2 layers x (q, v) x (A + B)


def test_half_base_keeps_float32_adapters():
    m = make("gpt2").to(torch.bfloat16)
    inject(m, method="krona", backend="reference", init="random")
    assert m.transformer.h[0].attn.c_attn.A.dtype == torch.float32
    assert m.transformer.h[0].attn.c_attn.base.weight.dtype == torch.bfloat16
    loss = m(**batch("gpt2")).loss
    loss.backward()
    assert m.transformer.h[0].attn.c_attn.A.grad.dtype == torch.float32


class _HeadGain(nn.Module):  # a toy model-level method: a per-layer gain on the final norm
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.base(x) * self.gain


def test_register_model_level_method(tmp_path):
    def apply(model, target, cfg):
        assert target.site == "model" and target.d_model == 32
        model.transformer.ln_f = _HeadGain(model.transformer.ln_f)
        return [model.transformer.ln_f]

    register_method("toy_model_level", site="model", wrap=apply)
    m = make("gpt2")
    inject(m, method="toy_model_level")
    assert get_state(m).adapter_modules == ["transformer.ln_f"]
    assert get_state(m).param_names == ["transformer.ln_f.gain"]
    assert m.transformer.ln_f.gain.requires_grad and not m.transformer.wte.weight.requires_grad
    save(m, str(tmp_path / "c"))
    load(make("gpt2"), str(tmp_path / "c"))


@pytest.mark.parametrize("arch,method", [("gpt2", "krona"), ("roberta", "lora"),
                                         ("gpt2", "kernel_mix"), ("llama", "kernel_mix")])
def test_merge_and_unload(arch, method):
    """GPT-2's per-head q|k|v adapter wraps the fused c_attn: it unloads to it."""
    from kfused.integration import merge_and_unload

    model = make(arch).double()
    plain_keys = set(make(arch).state_dict())
    targets = ["q", "v", "o"] if method.startswith("kernel") else None
    inject(model, AdapterConfig(method=method, init="random", adapter_dtype="float64",
                                targets=targets, backend="reference"))
    model.eval()
    inputs = batch(arch)
    with torch.no_grad():
        y0 = model(**inputs).logits
        merge_and_unload(model)
        y1 = model(**inputs).logits
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-10)
    assert set(model.state_dict()) == plain_keys
    assert get_state(model, required=False) is None
    inject(model, method="lora")  # an unloaded model can be adapted again


# ------------------------------------------------------------------------------------------
# a hostile probe's findings (stop 29): a failed inject changes nothing, configs are checked
# field by field, merge refuses tied weights


def _model_fingerprint(model):
    return ([(n, type(m).__name__) for n, m in model.named_modules()],
            {n: (p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()},
            getattr(model.config, "_attn_implementation", None))


def test_failed_inject_leaves_the_model_as_it_was():
    model = make("gpt2")
    before = _model_fingerprint(model)
    with pytest.raises(ValueError, match="is a LayerNorm"):  # fails after c_attn was wrapped
        inject(model, AdapterConfig(method="lora", targets=["c_attn", "ln_f"]))
    assert _model_fingerprint(model) == before and get_state(model, required=False) is None
    inject(model, AdapterConfig(method="lora", targets=["c_attn"]))  # and can be injected


@pytest.mark.parametrize("method", ["kernel_mix", "inducer", "prefix"])
def test_failed_attention_site_inject_is_undone(method, monkeypatch):
    """A method placed on attention blocks that fails at the second block (simulated): the
    first block's changes, the model config and every requires_grad flag are restored."""
    from kfused.integration import registry

    spec = registry.get_method(method)
    calls = []

    def failing_wrap(block, target, cfg):
        calls.append(block.name)
        if len(calls) == 2:
            raise ValueError("simulated failure at the second block")
        return real(block, target, cfg)

    real = spec.wrap
    monkeypatch.setattr(spec, "wrap", failing_wrap)
    model = make("llama")
    before = _model_fingerprint(model)
    with pytest.raises(ValueError, match="simulated failure"):
        inject(model, AdapterConfig(method=method, backend="reference"))
    assert len(calls) == 2
    assert _model_fingerprint(model) == before and get_state(model, required=False) is None


def test_unused_ranks_keys_are_refused():
    model = make("gpt2")  # GPT-2's fused c_attn has the role "qkv", not "q"
    with pytest.raises(ValueError, match=r"ranks keys \['q'\] match no adapted target"):
        inject(model, AdapterConfig(method="lora", ranks={"q": 2}))
    assert get_state(model, required=False) is None
    inject(model, AdapterConfig(method="lora", ranks={"qkv": 2}))
    assert model.transformer.h[0].attn.c_attn.A.shape[0] == 2
    llama = make("llama")  # per-head methods look their ranks up by projection
    inject(llama, AdapterConfig(method="kernel_mix", targets=["q", "v"],
                                ranks={"q": (1, 2), "v": (2, 1)}))
    with pytest.raises(ValueError, match=r"ranks keys \['o'\]"):
        inject(make("llama"), AdapterConfig(method="kernel_mix", targets=["q", "v"],
                                            ranks={"q": (1, 2), "o": (2, 1)}))


@pytest.mark.parametrize("fields,error,match", [
    (dict(r=1.7), TypeError, "r must be an integer"),
    (dict(r=True), TypeError, "r must be an integer"),
    (dict(r="8"), TypeError, "r must be an integer"),
    (dict(r=None), TypeError, "r must be an integer"),
    (dict(r=0), ValueError, "r must be an integer >= 1"),
    (dict(dropout=-0.5), ValueError, "dropout must be a probability"),
    (dict(dropout=1.0), ValueError, "dropout must be a probability"),
    (dict(alpha=0), ValueError, "alpha must be a finite non-zero"),
    (dict(alpha=float("inf")), ValueError, "alpha must be a finite non-zero"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    (dict(scale="2"), ValueError, "scale must be a finite number"),
    (dict(options=3), TypeError, "options must be a dict"),
    (dict(ranks=[1, 2]), TypeError, "ranks must be a dict"),
    (dict(ranks={"q": -1}), ValueError, r"ranks\['q'\] must be a non-negative integer"),
    (dict(ranks={"q": (1, 1.5)}), ValueError, r"ranks\['q'\]"),
    (dict(targets=5), TypeError, "targets must be a list of strings"),
    (dict(exclude=[3]), TypeError, "exclude must be a list of strings"),
    (dict(targets=["c_attn("]), ValueError, "not a valid regular expression"),
    (dict(a_shape=(4.0, 4)), ValueError, "a_shape must be"),
    (dict(b_shape=(0, 4)), ValueError, "b_shape must be"),
    (dict(backend="bogus"), ValueError, "backend='bogus' is not a backend"),
    (dict(bias=1), TypeError, "bias must be a bool"),
    (dict(method=3), TypeError, "method must be a method name"),
])
def test_config_fields_are_checked(fields, error, match):
    with pytest.raises(error, match=match):
        AdapterConfig(**fields)


def test_config_accepts_what_it_should():
    import numpy as np

    cfg = AdapterConfig(r=np.int64(4), alpha=-8, scale=0.0, dropout=0.0, targets="q",
                        ranks={"q": 0, "v": (3, 0)}, a_shape=[2, 3], backend="auto")
    assert cfg.r == 4 and type(cfg.r) is int and cfg.targets == ["q"] and cfg.a_shape == (2, 3)
    for name in ("lora-e2e", "kernel-mix-qvo-intermediate", "krona-glue", "mam-adapter"):
        preset(name)


@pytest.mark.parametrize("model,config", [(42, "lora-4"), (None, "lora-4"), ("gpt2", None)])
def test_inject_arguments_are_checked(model, config):
    if model == "gpt2":
        model, config = make("gpt2"), 42
    with pytest.raises(TypeError, match="must be"):
        inject(model, config)


def test_merge_refuses_tied_weights():
    """LoRA on GPT-2's lm_head, whose weight is the token embedding's: folding the update in
    would change the embedding too, so merge refuses and leaves the model unmerged."""
    model = make("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    inject(model, AdapterConfig(method="lora", targets=["lm_head"], init="random"))
    inputs = batch("gpt2")
    model.eval()
    with torch.no_grad():
        y = model(**inputs).logits
    emb = model.transformer.wte.weight.detach().clone()
    with pytest.raises(ValueError, match="tied weights"):
        merge(model)
    from kfused.integration import merge_and_unload
    with pytest.raises(ValueError, match="tied weights"):
        merge_and_unload(model)
    assert torch.equal(model.transformer.wte.weight, emb)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, y)


@pytest.mark.parametrize("cache_kw", ["cache", "past_key_values"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prefix_position_offset_continues_after_the_cache(arch, cache_kw):
    # options["position_offset"]: a decode step with a KV cache passed under either name
    # (transformers 5.x calls it ``cache``) continues the positions after the cached tokens
    model = make(arch).eval()
    inject(model, AdapterConfig(method="prefix", r=3, backend="reference",
                                options={"position_offset": 3}))
    ids = batch(arch, b=1, n=6)["input_ids"]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        step = model(input_ids=ids[:, 4:], use_cache=True, **{cache_kw: cache}).logits
    torch.testing.assert_close(step, full[:, 4:], rtol=1e-5, atol=1e-5)


def test_parallel_adapter_refuses_a_block_of_another_width():
    # a linear target whose output width is not the model width (Llama's grouped-query k_proj,
    # the FFN's first layer) was accepted and broke at forward inside a broadcast; a block
    # returning another shape is refused, never broadcast
    from kfused.modules.parallel_adapter import ScaledParallelAdapter

    for target in ("k", "ffn_in"):
        model = make("llama")
        with pytest.raises(ValueError, match=r"linear layer of \(in, out\) = \(32, \d+\)"):
            inject(model, AdapterConfig(method="parallel_adapter", targets=[target], r=2))
        assert get_state(model, required=False) is None
    ad = ScaledParallelAdapter(_FnBlock(lambda x: x[..., :1]), 8, r=2, init="random")
    with pytest.raises(ValueError, match=r"block returned shape \(3, 1\) .* expected \(3, 8\)"):
        ad(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"x has shape \(3, 6\)"):
        ad(torch.randn(3, 6))


class _FnBlock(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("method,options,exc,match", [
    ("lora", {"lite": ["v"]}, ValueError, r"'lora': unknown key\(s\) \['lite'\].*reads no options"),
    ("inducer", {"key_botleneck": 3}, ValueError, r"unknown key\(s\) \['key_botleneck'\]"),
    ("prefix", {"prefix_len": 3}, ValueError, r"'prefix': unknown key\(s\) \['prefix_len'\]"),
    ("kernel_mix", {"lite": ["v"], "rank": 3}, ValueError, r"unknown key\(s\) \['rank'\]"),
    ("mam_inducer", {"inducer": {"options": {"prefx_len": 1}}}, ValueError,
     r"'inducer': unknown key\(s\) \['prefx_len'\]"),
    ("mam_inducer", {"lora": {"r": 2}}, ValueError, r"'mam_inducer': unknown key\(s\) \['lora'\]"),
    ("mam", {"parallel_adapter": {"rr": 4}}, ValueError,
     r"options\['parallel_adapter'\] overrides .* \['rr'\] are not among them"),
    ("mam", {"prefix": {"method": "lora"}}, ValueError, r"\['method'\] are not among them"),
    ("mam_inducer", {"parallel_adapter": 16}, TypeError,
     r"options\['parallel_adapter'\] holds part 'parallel_adapter'.*got int 16"),
])
def test_unknown_option_keys_are_refused_by_name(method, options, exc, match):
    # every key a method does not read was silently dropped: a misspelt option trained
    # something else than the user asked for, with no word
    model = make("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        inject(model, AdapterConfig(method=method, r=2, options=options))
    assert get_state(model, required=False) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_dropout_no_part_applies_is_refused():
    # dropout=0.5 with KronA (or any method but LoRA) was accepted and trained without dropout
    for method in ("krona", "kernel_mix", "inducer", "mam"):
        model = make("llama")
        with pytest.raises(ValueError, match=rf"method '{method}' has no adapter dropout"):
            inject(model, AdapterConfig(method=method, r=2, dropout=0.5))
        assert get_state(model, required=False) is None
    model = make("llama")  # a composite with a LoRA part applies it there
    inject(model, AdapterConfig(method="inducer_lora", r=2, dropout=0.5, backend="reference"))
    assert model.model.layers[0].self_attn.q_proj.dropout.p == 0.5


def test_composite_shared_options_reach_the_parts_that_read_them():
    # a shared key goes to every part that reads it, and no other part refuses it
    model = make("llama")
    inject(model, AdapterConfig(method="mam_inducer", r=2, backend="reference",
                                options={"key_bottleneck": 3, "composition": "gate",
                                         "parallel_adapter": {"r": 4}}))
    inducers = [m for m in model.modules() if type(m).__name__ == "InducerAttention"]
    assert inducers and all(m.key_bottleneck == 3 and m.composition == "gate"
                            for m in inducers)


@pytest.mark.parametrize("method,options,match", [
    ("prefix", {"position_offset": 1.5}, r"options\['position_offset'\] must be an integer"),
    ("prefix", {"position_offset": "3"}, r"options\['position_offset'\] must be an integer"),
    ("inducer", {"key_bottleneck": "x"}, r"options\['key_bottleneck'\] must be an integer"),
    ("inducer", {"value_bottleneck": 2.5}, r"options\['value_bottleneck'\] must be an integer"),
    ("inducer", {"prefix_len": True}, r"options\['prefix_len'\] must be an integer"),
    ("inducer", {"position_offset": 2}, r"options\['position_offset'\] shifts the positions"),
])
def test_inducer_and_prefix_options_checked_by_name(method, options, match):
    # options were passed through int(): 1.5 became 1, "3" became 3, "x" gave int()'s own
    # message, and a position_offset given to the inducer was silently ignored
    model = make("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        inject(model, AdapterConfig(method=method, r=2, init="paper", options=options))
    assert get_state(model, required=False) is None
    assert model.config._attn_implementation == "eager"
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("lite", [["x"], ["o"], "q", [1]])
def test_headwise_lite_option_names_adapted_projections(lite):
    # options["lite"] entries that name no adapted projection were silently ignored (and a
    # string was read letter by letter)
    model = make("llama")
    with pytest.raises(ValueError, match=r"options\['lite'\] must be a list of the adapted"):
        inject(model, AdapterConfig(method="kernel_mix", r=2, targets=["q", "v"],
                                    options={"lite": lite}))
    assert get_state(model, required=False) is None


def test_backend_names_are_read_in_any_case_and_checked_where_given(monkeypatch):
    # AdapterConfig(backend="Triton") was refused while every op and module takes any case;
    # use_backend("tritn") was accepted and the first op then blamed $KFUSED_BACKEND
    from kfused.backends import BackendError
    from kfused.integration import use_backend

    assert AdapterConfig(backend="Triton").backend == "triton"
    assert AdapterConfig(backend="AUTO").backend == "auto"
    monkeypatch.delenv("KFUSED_BACKEND", raising=False)
    with pytest.raises(BackendError, match="backend='tritn' is not a backend"):
        with use_backend("tritn"):
            pass
    assert "KFUSED_BACKEND" not in os.environ
    with use_backend("Reference"):
        assert os.environ["KFUSED_BACKEND"] == "Reference"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("method", ["inducer", "prefix"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "roberta"])
def test_inducer_prefix_refuse_another_attention_implementation(arch, method, impl):
    # model.set_attn_implementation("sdpa") after inject ran the unadapted model: the other
    # implementation never calls the adapter ("add" passed plain rows through its projection)
    model = make(arch).eval()
    inject(model, AdapterConfig(method=method, r=2, init="paper", backend="reference"))
    inputs = batch(arch, n=6)
    with torch.no_grad():
        want = model(input_ids=inputs["input_ids"]).logits
        model.set_attn_implementation(impl)
        with pytest.raises(ValueError, match=f"attention implementation is '{impl}'"):
            model(input_ids=inputs["input_ids"])
        model.set_attn_implementation("kfused_inducer")
        assert torch.equal(model(input_ids=inputs["input_ids"]).logits, want)


@pytest.mark.parametrize("method", ["inducer", "prefix"])
def test_attention_layers_left_unadapted_take_the_configs_backend(method, monkeypatch):
    # inject switches every attention layer to kfused_inducer; a layer left without an
    # adapter (exclude) ran "auto" whatever AdapterConfig.backend said, and set_backend did
    # not reach it (on a GPU, backend="reference" still ran the fused kernel there)
    from kfused.integration import hf_attention

    model = make("llama").eval()
    inject(model, AdapterConfig(method=method, r=2, backend="reference",
                                exclude=[r"model\.layers\.1\..*"]))
    assert [n.split(".")[2] for n in get_state(model).adapter_modules] == ["0"]
    seen = []
    real = hf_attention.inducer_attention
    monkeypatch.setattr(hf_attention, "inducer_attention",
                        lambda *a, **k: seen.append(k.get("backend")) or real(*a, **k))
    ids = batch("llama", n=5)["input_ids"]
    with torch.no_grad():
        model(input_ids=ids)
        assert seen == ["reference"]                 # the unadapted layer 1
        set_backend(model, "auto")
        model(input_ids=ids)
    assert seen == ["reference", "auto"]


@pytest.mark.parametrize("method", ["inducer", "prefix", "mam"])
def test_inducer_prefix_refuse_attention_softcapping_at_inject(method):
    # a Gemma-2 model (Llama-style layout, attention logit soft-capping) took the adapter,
    # then refused every forward (the attention is handed softcap=): refused at inject, model
    # unchanged; with the soft-capping turned off it runs
    import transformers

    def gemma2(softcap):
        torch.manual_seed(0)
        cfg = transformers.Gemma2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, vocab_size=64, attn_logit_softcapping=softcap)
        return transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager")

    init = None if method == "mam" else "paper"
    model = gemma2(50.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50\.0"):
        inject(model, AdapterConfig(method=method, r=2, init=init))
    assert get_state(model, required=False) is None
    assert model.config._attn_implementation == "eager"
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())
    model = gemma2(None)
    inject(model, AdapterConfig(method=method, r=2, init=init, backend="reference"))
    assert model(input_ids=torch.randint(3, 64, (1, 5))).logits.isfinite().all()


# ------------------------------------------------------------------------------------------
# a probe of the integration layer: merge with mixed dtypes and all or nothing, options and
# ranks checked by name, set_backend checked where given


@pytest.mark.parametrize("base_dtype,adapter_dtype", [(torch.bfloat16, "float32"),
                                                      (torch.float32, "bfloat16")])
@pytest.mark.parametrize("method", ["kernel_wise_lite", "kernel_mix_lite"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lite_merge_on_a_base_of_another_dtype(arch, method, base_dtype, adapter_dtype):
    # merge() of the lite methods failed ("expected m1 and m2 to have the same dtype"): the
    # frozen W_k in the base dtype met the adapter's factors in one einsum
    model = make(arch).to(base_dtype).eval()
    inject(model, AdapterConfig(method=method, backend="reference", init="random",
                                adapter_dtype=adapter_dtype))
    inputs = {"input_ids": batch(arch)["input_ids"]}
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        y0 = model(**inputs).logits.float()
        merge(model)
        y1 = model(**inputs).logits.float()
        unmerge(model)
    torch.testing.assert_close(y1, y0, rtol=0.05, atol=0.05)
    after = model.state_dict()
    assert all(torch.allclose(after[k].float(), v.float(), atol=0.02) for k, v in frozen.items())


@pytest.mark.parametrize("unload", [False, True])
def test_merge_is_all_or_nothing(unload, monkeypatch):
    # a module failing to merge left the modules before it merged (merge_and_unload: folded
    # and swapped out for their base layers, the adapter lost while kfused_state listed it)
    from kfused.integration import adapter_modules, merge_and_unload, merged_modules

    model = make("llama")  # 2 layers x (q, v): the third module fails
    inject(model, AdapterConfig(method="lora", backend="reference", init="random"))
    mods = list(adapter_modules(model).values())

    def fail():
        raise RuntimeError("simulated merge failure")

    monkeypatch.setattr(mods[2], "merge", fail)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="simulated merge failure"):
        (merge_and_unload if unload else merge)(model)
    assert merged_modules(model) == []
    assert [type(m) for m in adapter_modules(model).values()] == [LoRALinear] * 4
    after = model.state_dict()  # (unmerge is exact up to the rounding of the add / subtract)
    assert set(after) == set(weights)
    assert all(torch.allclose(after[k], v, rtol=0, atol=1e-6) for k, v in weights.items())
    monkeypatch.undo()
    (merge_and_unload if unload else merge)(model)  # and it merges once the failure is gone
    assert (get_state(model, required=False) is None) if unload else merged_modules(model)


@pytest.mark.parametrize("unload", [False, True])
@pytest.mark.parametrize("k_method", ["lora", "krona"])
def test_merge_of_a_lite_part_whose_key_projection_another_part_adapts(k_method, unload):
    # Kernel-wise-lite's update of v reads the frozen key projection (W_v += W_k A B), which
    # an earlier part of a composite adapted (LoRA / KronA on k): merged in injection order,
    # the k part folded its update into W_k first and the lite part then folded W_k + dW_k
    # (merged logits 0.16 off the unmerged ones), and unmerge left every v weight changed
    from kfused.integration import merge_and_unload

    register_method(f"{k_method}_k_lite_v", site="composite", replace=True,
                    parts=[(k_method, ["k"]), ("kernel_wise_lite", ["v"])])
    model = make("llama").eval()
    inject(model, AdapterConfig(method=f"{k_method}_k_lite_v", r=2, init="random",
                                backend="reference"))
    ids = batch("llama")["input_ids"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(input_ids=ids).logits
        (merge_and_unload if unload else merge)(model)
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        if unload:
            return
        unmerge(model)
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    after = model.state_dict()
    assert all(torch.allclose(after[k], v, rtol=0, atol=1e-6) for k, v in weights.items())


@pytest.mark.parametrize("shapes,exc,match", [
    ([1, 2], TypeError, r"options\['krona_shapes'\] must be a dict"),
    ({"transformer.h.0.attn.c_attn": 5}, ValueError,
     r"options\['krona_shapes'\]\['transformer.h.0.attn.c_attn'\] must be \[a_shape, b_shape\]"),
    ({"transformer.h.0.attn.c_attn": [[2, 4], [48]]}, ValueError, r"must be \[a_shape"),
    ({"transformer.h.0.attn.c_atn": [[2, 4], [48, 8]]}, ValueError,
     r"options\['krona_shapes'\] names \['transformer.h.0.attn.c_atn'\], which match no"),
])
def test_krona_shapes_option_is_checked(shapes, exc, match):
    # a list gave an AttributeError, a bad entry "'int' object is not subscriptable", and a
    # misspelt module name was dropped (its module took the default shapes)
    model = make("gpt2", n_layers=1)
    before = _model_fingerprint(model)
    with pytest.raises(exc, match=match):
        inject(model, AdapterConfig(method="krona", backend="reference",
                                    options={"krona_shapes": shapes}))
    assert _model_fingerprint(model) == before and get_state(model, required=False) is None
    inject(model, AdapterConfig(method="krona", backend="reference", options={
        "krona_shapes": {"transformer.h.0.attn.c_attn": [[2, 4], [48, 8]]}}))
    assert model.transformer.h[0].attn.c_attn.A.shape == (2, 4)


def test_krona_lora_rank_budget():
    """options['lora_rank_budget'] = r: each layer's factor shapes with at most the parameters
    of a rank-r LoRA there (the demo's KronA row)."""
    model = make("gpt2", n_layers=1)
    inject(model, AdapterConfig(method="krona", backend="reference",
                                options={"lora_rank_budget": 2}))
    m = model.transformer.h[0].attn.c_attn
    d_in, d_out = 32, 96
    assert m.A.numel() + m.B.numel() <= 2 * (d_in + d_out)
    assert m.A.shape[0] * m.B.shape[0] == d_out and m.A.shape[1] * m.B.shape[1] == d_in
    for opts, kw, match in (({"lora_rank_budget": 0}, {}, "integer rank >= 1"),
                            ({"lora_rank_budget": 2.5}, {}, "integer rank >= 1"),
                            ({"lora_rank_budget": 2}, dict(a_shape=(2, 2), b_shape=(48, 16)),
                             "not both")):
        fresh = make("gpt2", n_layers=1)
        with pytest.raises(ValueError, match=match):
            inject(fresh, AdapterConfig(method="krona", backend="reference", options=opts, **kw))
        assert get_state(fresh, required=False) is None


def test_a_parts_own_ranks_keys_are_checked():
    # options[part]['ranks'] keys that match none of the part's targets were dropped silently
    # (the same key in AdapterConfig.ranks is refused)
    model = make("llama")
    with pytest.raises(ValueError, match=r"options\['lora'\]\['ranks'\] keys \['vv'\] match no"):
        inject(model, AdapterConfig(method="inducer_lora", backend="reference",
                                    options={"lora": {"ranks": {"q": 2, "vv": 5}}}))
    assert get_state(model, required=False) is None
    inject(model, AdapterConfig(method="inducer_lora", backend="reference",
                                options={"lora": {"ranks": {"q": 2, "v": 5}}}))
    assert model.model.layers[0].self_attn.v_proj.r == 5


@pytest.mark.parametrize("config,exc,match", [
    (dict(method="lora", ranks={"qkv": (2, 3)}), ValueError,
     r"ranks\['qkv'\] = \(2, 3\): method 'lora' takes one rank per target"),
    (dict(method="parallel_adapter", ranks={"ffn": (2, 3)}), ValueError,
     r"ranks\['ffn'\] = \(2, 3\): method 'parallel_adapter' takes one rank"),
    (dict(method="kernel_wise", ranks={"q": (2, 3)}), ValueError,
     r"ranks\['q'\] = \(2, 3\): method 'kernel_wise' takes one rank"),
    (dict(method="mam", options={"prefix": {"options": [1]}}), TypeError,
     r"options\['prefix'\]\['options'\] holds part 'prefix'.* must be a dict, got list"),
])
def test_rank_tuples_and_part_options_are_refused_by_name(config, exc, match):
    # Python's bare "int() argument must be ..." / "'list' object is not a mapping"
    model = make("gpt2")
    before = _model_fingerprint(model)
    with pytest.raises(exc, match=match):
        inject(model, AdapterConfig(backend="reference", **config))
    assert _model_fingerprint(model) == before and get_state(model, required=False) is None


def test_set_backend_refuses_a_name_that_is_no_backend():
    # set_backend(model, "bogus") was accepted and every later forward failed
    from kfused.backends import BackendError

    model = make("gpt2")
    inject(model, AdapterConfig(method="krona", backend="reference"))
    with pytest.raises(BackendError, match="backend='bogus' is not a backend"):
        set_backend(model, "bogus")
    assert model.transformer.h[0].attn.c_attn.backend == "reference"
    set_backend(model, "Reference")
    model(**batch("gpt2"))


def test_prefix_position_offset_must_leave_a_learned_position():
    # an offset at or past GPT-2's n_positions was accepted; every forward then failed inside
    # torch.embedding
    model = make("gpt2", max_len=32)
    with pytest.raises(ValueError, match=r"options\['position_offset'\]=32 is at or past the "
                                         r"end of this 'gpt2' model's 32 learned positions"):
        inject(model, AdapterConfig(method="prefix", r=2, backend="reference",
                                    options={"position_offset": 32}))
    assert get_state(model, required=False) is None
    inject(model, AdapterConfig(method="prefix", r=2, backend="reference",
                                options={"position_offset": 20}))
    assert model(input_ids=batch("gpt2")["input_ids"]).logits.isfinite().all()
    llama = make("llama", max_len=32)  # rotary positions: no table to run past
    inject(llama, AdapterConfig(method="prefix", r=2, backend="reference",
                                options={"position_offset": 40}))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("method", ["inducer", "inducer_lora", "kernel_mix", "parallel_adapter"])
def test_every_placed_module_takes_the_model_mode(method, training):
    # the inducer's adapter sits inside a wrapper inject itself placed (the output projection's
    # InducerOutputProjection): both took that new wrapper's default training mode, so an
    # eval-mode model came back with them in training mode
    model = make("roberta").train(training)
    inject(model, AdapterConfig(method=method, backend="reference"))
    assert {n for n, m in model.named_modules() if m.training != training} == set()


@pytest.mark.parametrize("training", [False, True])
def test_add_inducers_placed_modules_take_the_model_mode(training):
    # add_inducers (the lower-level entry point) left its wrappers and adapters in nn.Module's
    # default training mode on an eval-mode model, unlike inject
    from kfused.integration.hf_attention import add_inducers

    model = make("gpt2").train(training)
    add_inducers(model)
    assert {n for n, m in model.named_modules() if m.training != training} == set()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_inducer_composite_with_lora_on_the_output_projection(arch, tmp_path):
    # inducer_lora with the LoRA part on o as well: the inducer's wrapper of o then holds a
    # LoRALinear, which attach_inducer_block refused ("expected nn.Linear or transformers
    # Conv1D, got LoRALinear"); the wrapper maps f through the adapted o, u through W2
    from kfused.integration.hf_attention import InducerOutputProjection

    model = make(arch).eval()
    inject(model, AdapterConfig(method="inducer_lora", backend="reference",
                                options={"lora": {"targets": ["q", "v", "o"]}}))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    ids = batch(arch)["input_ids"]
    got = model(ids).logits
    wrappers = [m for m in model.modules() if isinstance(m, InducerOutputProjection)]
    assert wrappers and all(isinstance(w.base, LoRALinear) for w in wrappers)
    got.sum().backward()
    idle = [n for n, p in model.named_parameters() if p.requires_grad
            and (p.grad is None or not p.grad.any())]
    assert idle == [], idle
    save(model, str(tmp_path / "c"))
    fresh = make(arch).eval()
    load(fresh, str(tmp_path / "c"))
    assert torch.equal(fresh(ids).logits, got)
    # the o LoRA's update is in the output: with B = 0 the model equals the one whose wrapper
    # holds the bare projection (the fused single-GEMM path)
    with torch.no_grad():
        for w in wrappers:
            w.base.B.zero_()
        off = model(ids).logits
        assert not torch.equal(off, got)
        for w in wrappers:
            w.base = w.base.base
            w.layout = "linear" if isinstance(w.base, nn.Linear) else "conv1d"
        torch.testing.assert_close(model(ids).logits, off, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch,parts", [
    ("llama", [("lora", ["q"]), ("krona", ["q"])]),
    ("gpt2", [("lora", ["q"]), ("krona", ["v"])]),      # q and v are one module, c_attn
    ("roberta", [("parallel_adapter", ["ffn"]), ("krona_b", ["ffn"])])])
def test_composite_parts_on_the_same_module_are_refused(arch, parts):
    # a later part whose target an earlier part already wrapped was skipped without a word:
    # inject succeeded with that part missing from the model
    name = "probe_same_" + "_".join(p for p, _ in parts)
    register_method(name, site="composite", parts=parts)
    model = make(arch)
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match=rf"method '{parts[1][0]}': target '.*' \(role "
                                         r"'\w+'\) is already adapted by an earlier part"):
        inject(model, AdapterConfig(method=name, backend="reference"))
    assert get_state(model, required=False) is None and set(model.state_dict()) == keys


@pytest.mark.parametrize("arch,cfg", [("gpt2", dict(method="lora")),
                                      ("llama", dict(method="lora", targets=["o"])),
                                      ("roberta", dict(method="kernel_mix", targets=["o"]))])
def test_add_inducers_on_an_injected_model_is_refused(arch, cfg):
    # add_inducers after inject froze the injected adapters (freeze_base) and left the
    # inducers out of the record save reads: save dropped them, or, with o adapted and wrapped
    # again, failed with "InducerOutputProjection has no attribute `A`"
    from kfused.integration.hf_attention import add_inducers

    model = make(arch)
    inject(model, AdapterConfig(backend="reference", **cfg))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match=rf"add_inducers: this model already has kfused "
                                         rf"adapters \(method '{cfg['method']}'"):
        add_inducers(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert set(model.state_dict()) == keys


@pytest.mark.parametrize("arch,cfg", [("gpt2", dict(method="lora")),
                                      ("roberta", dict(method="krona", targets=["o"]))])
def test_inject_on_a_model_with_add_inducers_adapters_is_refused(arch, cfg):
    # inject after add_inducers froze the inducers with the base and left them out of the
    # record save reads: the saved adapter, loaded into a fresh model, gave another model
    from kfused.integration.hf_attention import add_inducers

    model = make(arch)
    add_inducers(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match=r"inject: .* already has an inducer/prefix adapter "
                                         r"placed by add_inducers \(2 layer\(s\)\)"):
        inject(model, AdapterConfig(backend="reference", **cfg))
    assert get_state(model, required=False) is None
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
