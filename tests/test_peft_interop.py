"""kfused.from_peft / kfused.to_peft against the real `peft` package (issue 17).

Tiny GPT-2, RoBERTa and Llama built from configs. Logits and every adapter gradient of the
converted model are checked against the PEFT model under docs/math.md §4 (kfused.testing: the kfused
model in float32 against PEFT in float64 and float32), round trips PEFT -> kfused -> PEFT
reproduce PEFT's tensors and logits, and one optimiser step on each side lands on the same
factors.
"""

import copy
import json
import os
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import (IA3Config, LoKrConfig, LoraConfig, PeftModel, PrefixTuningConfig,  # noqa: E402
                  get_peft_model)
from safetensors.torch import load_file  # noqa: E402

import kfused  # noqa: E402
from kfused.integration import AdapterConfig  # noqa: E402
from kfused.integration.peft_interop import PEFT_WEIGHTS, PeftConversionError  # noqa: E402
from kfused.modules.krona import KronALinear  # noqa: E402
from kfused.modules.lora import LoRALinear  # noqa: E402
from kfused.testing import assert_against_reference  # noqa: E402

from _hf_helpers import batch, make  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LORA_TARGETS = {"gpt2": ["c_attn"], "roberta": ["query", "value"], "llama": ["q_proj", "v_proj"]}
LOKR_TARGETS = {"roberta": ["query", "value"], "llama": ["q_proj", "k_proj", "v_proj"]}


def _peft_model(arch, cfg, seed=0, **kw):
    base = make(arch, seed=seed, **kw)
    torch.manual_seed(seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(base, cfg).eval()


def _lora_cfg(arch, **kw):
    kw.setdefault("r", 4)
    kw.setdefault("lora_alpha", 8)
    return LoraConfig(target_modules=LORA_TARGETS[arch], init_lora_weights=False,
                      fan_in_fan_out=(arch == "gpt2"), **kw)


def _lokr_cfg(arch, **kw):
    kw.setdefault("r", 8)
    kw.setdefault("alpha", 12)
    return LoKrConfig(target_modules=LOKR_TARGETS[arch], init_weights=False, **kw)


def _peft_name(kf_name: str) -> str:
    """kfused adapter parameter name -> the PEFT parameter holding the same factor."""
    mod, _, p = kf_name.rpartition(".")
    suffix = {"lora": {"A": "lora_A.default.weight", "B": "lora_B.default.weight"},
              "krona": {"A": "lokr_w1.default", "B": "lokr_w2.default"}}
    return mod, p, suffix


def _param_pairs(kf, pm):
    """[(kfused name, PEFT name)] for every kfused adapter parameter."""
    method = kf.kfused_state.config.method
    peft_params = dict(pm.named_parameters())
    pairs = []
    for n in kf.kfused_state.param_names:
        mod, p, suffix = _peft_name(n)
        pn = f"base_model.model.{mod}.{suffix[method][p]}"
        assert pn in peft_params, (pn, sorted(peft_params)[:6])
        pairs.append((n, pn))
    return pairs


def _spec4_check(arch, pm, kf, dtype=torch.float32, n=7, device="cpu"):
    """docs/math.md §4: the kfused model (in ``dtype``, on ``device``) against the PEFT model in
    float64 (on the CPU) and in ``dtype`` (on ``device``, as kfused.testing runs torch_t), for
    the logits and the gradients of the input and every adapter factor."""
    pairs = _param_pairs(kf, pm)
    ref64 = copy.deepcopy(pm).double().eval()
    ref_t = copy.deepcopy(pm).to(device=device, dtype=dtype).eval()
    kf = kf.to(device=device, dtype=dtype).eval()
    d = kf.config.hidden_size
    g = torch.Generator().manual_seed(3)
    inputs = {"emb": torch.randn(2, n, d, generator=g, dtype=torch.float64)}
    params = dict(kf.named_parameters())
    for i, (kn, _) in enumerate(pairs):
        inputs[f"p{i}"] = params[kn].detach().double()

    def kernel_fn(emb, **ps):
        over = {kn: ps[f"p{i}"] for i, (kn, _) in enumerate(pairs)}
        return torch.func.functional_call(kf, over, (), {"inputs_embeds": emb}).logits

    def ref_fn(emb, **ps):
        model = ref64 if emb.dtype == torch.float64 else ref_t
        over = {pn: ps[f"p{i}"] for i, (_, pn) in enumerate(pairs)}
        return torch.func.functional_call(model, over, (), {"inputs_embeds": emb}).logits

    res = assert_against_reference(kernel_fn, ref_fn, inputs, dtype, device)
    assert len(res) == 2 + len(pairs)  # logits, d(emb), one gradient per factor
    return res


def _state(model):
    return ({n: type(m).__name__ for n, m in model.named_modules()},
            {n: p.detach().clone() for n, p in model.named_parameters()})


def _assert_unchanged(model, before):
    mods, params = _state(model)
    assert mods == before[0]
    assert params.keys() == before[1].keys()
    for k, v in params.items():
        assert torch.equal(v, before[1][k]), k


# ------------------------------------------------------------------------------------------
# PEFT -> kfused: exact conversion


@pytest.mark.parametrize("arch", ["gpt2", "roberta", "llama"])
def test_from_peft_lora_spec4(arch):
    kw = {"rank_pattern": {"v_proj": 2}} if arch == "llama" else {}
    pm = _peft_model(arch, _lora_cfg(arch, **kw))
    ref = copy.deepcopy(pm)
    kf = kfused.from_peft(pm, backend="reference")
    assert kf is pm.base_model.model
    mods = kfused.integration.adapter_modules(kf)
    assert len(mods) == 2 * len(LORA_TARGETS[arch])
    assert all(isinstance(m, LoRALinear) for m in mods.values())
    if arch == "llama":  # per-module rank kept, alpha shared: scale = 8/2 on v, 8/4 on q
        assert {m.r for m in mods.values()} == {2, 4}
        assert {m.scale for m in mods.values()} == {2.0, 4.0}
    trainable = {n for n, p in kf.named_parameters() if p.requires_grad}
    assert trainable == set(kf.kfused_state.param_names)
    _spec4_check(arch, ref, kf)


@pytest.mark.parametrize("arch,kw", [("roberta", {}), ("llama", {"decompose_factor": 2})])
def test_from_peft_lokr_spec4(arch, kw):
    pm = _peft_model(arch, _lokr_cfg(arch, **kw))
    ref = copy.deepcopy(pm)
    kf = kfused.from_peft(pm, backend="reference")
    mods = kfused.integration.adapter_modules(kf)
    assert all(isinstance(m, KronALinear) for m in mods.values())
    assert {m.scale for m in mods.values()} == {12 / 8}
    for name, m in mods.items():  # A = w1, B = w2 exactly
        layer = ref.base_model.model.get_submodule(name)
        assert torch.equal(m.A, layer.lokr_w1["default"])
        assert torch.equal(m.B, layer.lokr_w2["default"])
    if kw:  # decompose_factor=2: w1 is (2, 2) everywhere
        assert {tuple(m.A.shape) for m in mods.values()} == {(2, 2)}
    _spec4_check(arch, ref, kf)


def test_from_peft_lokr_decomposed_factors_are_folded():
    """w1 = w1_a w1_b / w2 = w2_a w2_b (decompose_both, small r) become full A, B: the same
    function, and PEFT's factor gradients follow from kfused's by the chain rule."""
    pm = _peft_model("llama", _lokr_cfg("llama", r=1, alpha=3, decompose_both=True)).double()
    layer0 = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert "default" in layer0.lokr_w1_a and "default" in layer0.lokr_w2_a
    ref = copy.deepcopy(pm)
    kf = kfused.from_peft(pm, backend="reference")
    assert kf.kfused_state.config.adapter_dtype == "float64"
    emb = torch.randn(2, 6, kf.config.hidden_size, dtype=torch.float64)
    gout = torch.randn(2, 6, kf.config.vocab_size, dtype=torch.float64)
    y_ref = ref(inputs_embeds=emb).logits
    y_kf = kf(inputs_embeds=emb).logits
    torch.testing.assert_close(y_kf, y_ref, rtol=1e-12, atol=1e-12)
    (y_ref * gout).sum().backward()
    (y_kf * gout).sum().backward()
    for name, m in kfused.integration.adapter_modules(kf).items():
        lay = ref.base_model.model.get_submodule(name)
        w1a, w1b = lay.lokr_w1_a["default"], lay.lokr_w1_b["default"]
        w2a, w2b = lay.lokr_w2_a["default"], lay.lokr_w2_b["default"]
        torch.testing.assert_close(m.A, w1a @ w1b, rtol=0, atol=0)
        torch.testing.assert_close(m.B, w2a @ w2b, rtol=0, atol=0)
        torch.testing.assert_close(w1a.grad, m.A.grad @ w1b.T, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w1b.grad, w1a.T @ m.A.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w2a.grad, m.B.grad @ w2b.T, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w2b.grad, w2a.T @ m.B.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["lora", "lokr"])
def test_from_peft_on_t5_feed_forward(kind):
    """PEFT adapters on T5's feed-forward output ``wo``: T5's forward reads
    ``self.wo.weight.dtype``, so the kfused layer exposes its base weight as PEFT's layers do
    (the converted model's forward raised AttributeError)."""
    targets = ["q", "v", "wo"]
    cfg = (LoraConfig(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False)
           if kind == "lora" else LoKrConfig(target_modules=targets, r=8, alpha=12,
                                             init_weights=False))
    pm = _peft_model("t5", cfg)
    inputs = batch("t5")
    with torch.no_grad():
        want = pm(**inputs).logits
    kf = kfused.from_peft(pm, backend="reference").eval()
    wo = kf.encoder.block[0].layer[1].DenseReluDense.wo
    assert isinstance(wo, (LoRALinear, KronALinear)) and wo.weight is wo.base.weight
    with torch.no_grad():
        torch.testing.assert_close(kf(**inputs).logits, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("training", [False, True])
def test_from_peft_keeps_the_model_mode(training):
    """The converted layers take the model's mode: converting an eval-mode PeftModel whose
    LoRA has dropout gave inference with that dropout on (new modules start in training
    mode), so logits differed from PEFT's at random."""
    pm = _peft_model("llama", _lora_cfg("llama", lora_dropout=0.5)).train(training)
    ids = batch("llama")["input_ids"]
    with torch.no_grad():
        want = pm.eval()(input_ids=ids).logits
    pm.train(training)
    kf = kfused.from_peft(pm, backend="reference")
    assert {m.training for m in kf.modules()} == {training}
    if not training:
        with torch.no_grad():
            torch.testing.assert_close(kf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)


def test_from_peft_triton_kernels_interpreter(device):
    """The fused KronA kernel (backend='triton', CPU interpreter under TRITON_INTERPRET=1, or
    compiled on a GPU) on a converted PEFT LoKr adapter, under docs/math.md §4."""
    if not kfused.backends.triton_interpret() and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest on CPU) or a GPU")
    pm = _peft_model("roberta", _lokr_cfg("roberta"))
    ref = copy.deepcopy(pm)
    kf = kfused.from_peft(pm, backend="triton")
    assert {m.backend for m in kfused.integration.adapter_modules(kf).values()} == {"triton"}
    _spec4_check("roberta", ref, kf, n=5, device=device)


def test_from_peft_folder_and_kfused_api():
    """from_peft(model, folder) == from_peft(peft_model); then save / load / merge / unmerge
    treat the result as an injected model."""
    pm = _peft_model("llama", _lokr_cfg("llama"))
    ids = batch("llama")["input_ids"]
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        pm.save_pretrained(os.path.join(d, "peft"))
        kf = kfused.from_peft(make("llama"), os.path.join(d, "peft"), backend="reference").eval()
        with torch.no_grad():
            got = kf(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        kfused.save(kf, os.path.join(d, "kf"))
        fresh = kfused.load(make("llama"), os.path.join(d, "kf")).eval()
        with torch.no_grad():
            assert torch.equal(fresh(input_ids=ids).logits, got)
    kfused.merge(kf)
    with torch.no_grad():
        torch.testing.assert_close(kf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    kfused.unmerge(kf)
    with torch.no_grad():
        torch.testing.assert_close(kf(input_ids=ids).logits, got, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# prefix tuning


PREFIX_ARCHS = [("gpt2", {}), ("llama", {"n_heads": 1})]  # Llama with one kv head per head


@pytest.mark.parametrize("arch,kw", PREFIX_ARCHS)
def test_from_peft_prefix_spec4(arch, kw):
    """PEFT's prompt_embeddings E (l, 2·layers·d) -> per-layer prefix_k / prefix_v; logits and
    dE under docs/math.md §4 (the kfused gradient reaches E through the same reshape)."""
    l = 3
    base = make(arch, **kw)
    torch.manual_seed(5)
    pm = get_peft_model(base, PrefixTuningConfig(num_virtual_tokens=l,
                                                 task_type="CAUSAL_LM")).eval()
    ref64, ref32 = copy.deepcopy(pm).double(), copy.deepcopy(pm)
    kf = kfused.from_peft(pm, backend="reference").eval()
    assert kf.kfused_state.config.method == "prefix"
    assert kf.kfused_state.config.options == {"position_offset": l}
    mods = list(kfused.integration.adapter_modules(kf).values())
    H, p = mods[0].num_heads, mods[0].head_dim
    ename = "prompt_encoder.default.embedding.weight"
    inputs = {"emb": torch.randn(2, 5, kf.config.hidden_size, dtype=torch.float64),
              "E": pm.get_parameter(ename).detach().double()}

    def kernel_fn(emb, E):
        Ev = E.reshape(l, 2 * len(mods), H, p)
        over = {}
        for i, name in enumerate(kfused.integration.adapter_modules(kf)):
            over[f"{name}.prefix_k"] = Ev[:, 2 * i].permute(1, 0, 2)
            over[f"{name}.prefix_v"] = Ev[:, 2 * i + 1].permute(1, 0, 2)
        return torch.func.functional_call(kf, over, (), {"inputs_embeds": emb}).logits

    def ref_fn(emb, E):
        model = ref64 if emb.dtype == torch.float64 else ref32
        return torch.func.functional_call(model, {ename: E}, (), {"inputs_embeds": emb}).logits

    assert_against_reference(kernel_fn, ref_fn, inputs, torch.float32)


@pytest.mark.parametrize("arch,kw", PREFIX_ARCHS)
def test_prefix_round_trip_and_training(arch, kw, tmp_path):
    l = 4
    pm = get_peft_model(make(arch, **kw), PrefixTuningConfig(num_virtual_tokens=l,
                                                             task_type="CAUSAL_LM")).eval()
    inputs = batch(arch)
    ids = inputs["input_ids"]
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "orig")
    kf = kfused.from_peft(make(arch, **kw), tmp_path / "orig", backend="reference").eval()
    with torch.no_grad():
        torch.testing.assert_close(kf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    out = kfused.to_peft(kf, tmp_path / "back")
    a = load_file(tmp_path / "orig" / "adapter_model.safetensors")
    b = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert torch.equal(a["prompt_embeddings"], b["prompt_embeddings"])
    # kfused checkpoint round trip keeps the position shift (it is in the config)
    kfused.save(kf, tmp_path / "kf")
    again = kfused.load(make(arch, **kw), tmp_path / "kf").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, kf(input_ids=ids).logits)
    # one SGD step on each side: the same prefix afterwards; exported, PEFT gives kfused's logits
    for model in (pm, kf):
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        model(**inputs).loss.backward()
        opt.step()
        model.eval()
    out = kfused.to_peft(kf, tmp_path / "back")
    torch.testing.assert_close(load_file(os.path.join(out, "adapter_model.safetensors"))[
        "prompt_embeddings"], pm.get_parameter("prompt_encoder.default.embedding.weight"),
        rtol=1e-4, atol=1e-6)
    back = PeftModel.from_pretrained(make(arch, **kw), out).eval()
    with torch.no_grad():
        got, exp = back(input_ids=ids).logits, kf(input_ids=ids).logits
    assert not torch.allclose(exp, want)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# round trips and training


@pytest.mark.parametrize("arch,kind", [("gpt2", "lora"), ("roberta", "lora"), ("llama", "lokr"),
                                       ("llama", "lora")])
def test_round_trip_peft_kfused_peft(arch, kind, tmp_path):
    cfg = _lora_cfg(arch) if kind == "lora" else _lokr_cfg(arch, decompose_factor=2)
    pm = _peft_model(arch, cfg)
    ids = batch(arch)["input_ids"]
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "orig")
    kf = kfused.from_peft(pm, backend="reference")
    out = kfused.to_peft(kf, tmp_path / "back")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors",
                                       "kfused_export.json"]
    a, b = load_file(tmp_path / "orig" / "adapter_model.safetensors"), load_file(
        os.path.join(out, "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = PeftModel.from_pretrained(make(arch), out).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, want)


@pytest.mark.parametrize("arch,kind", [("gpt2", "lora"), ("llama", "lokr")])
def test_training_step_matches_peft(arch, kind, tmp_path):
    """One SGD step on the PEFT model and one on the converted model (float64) land on the same
    factors; the trained kfused adapter exported with to_peft gives PEFT the same logits."""
    cfg = _lora_cfg(arch) if kind == "lora" else _lokr_cfg(arch)
    pm = _peft_model(arch, cfg).double().train()
    kf = kfused.from_peft(copy.deepcopy(pm), backend="reference").train()
    inputs = batch(arch)
    pairs = _param_pairs(kf, pm)
    kp, pp = dict(kf.named_parameters()), dict(pm.named_parameters())
    losses = []
    for model in (pm, kf):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for kn, pn in pairs:
        assert not torch.equal(kp[kn], pm.get_parameter(pn).new_zeros(())), kn
        torch.testing.assert_close(kp[kn], pp[pn], rtol=1e-10, atol=1e-12)
    kf.eval()
    out = kfused.to_peft(kf, tmp_path / "trained")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = PeftModel.from_pretrained(make(arch).double(), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=inputs["input_ids"]).logits,
                                   kf(input_ids=inputs["input_ids"]).logits,
                                   rtol=1e-12, atol=1e-12)
    # and PEFT trains on from there
    back.train()
    for p in back.parameters():
        p.requires_grad_(False)
    params = [p for n, p in back.named_parameters() if "lora_" in n or "lokr_" in n]
    for p in params:
        p.requires_grad_(True)
    back(**inputs).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


# ------------------------------------------------------------------------------------------
# kfused -> PEFT from an injected model


@pytest.mark.parametrize("arch,cfg", [
    ("gpt2", AdapterConfig(method="lora", r=4, alpha=16, init="random")),
    # Conv1D and nn.Linear layers in one adapter: PEFT sets fan_in_fan_out per layer
    ("gpt2", AdapterConfig(method="lora", targets=["c_attn", "lm_head"], r=4, init="random")),
    ("llama", AdapterConfig(method="lora", targets=["q", "v", "o"], r=4, ranks={"o": 2},
                            init="random")),
    ("llama", AdapterConfig(method="krona", targets=["q", "k", "v"], scale=3.0, init="random")),
    ("roberta", AdapterConfig(method="krona", targets=["q", "v"], a_shape=(2, 2), scale=0.5,
                              init="random")),
])
def test_to_peft_from_inject(arch, cfg, tmp_path):
    kf = kfused.inject(make(arch), cfg.replace(backend="reference")).eval()
    ids = batch(arch)["input_ids"]
    out = kfused.to_peft(kf, tmp_path / "p")
    meta = json.load(open(os.path.join(out, "adapter_config.json")))
    assert meta["peft_type"] == ("LORA" if cfg.method == "lora" else "LOKR")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = PeftModel.from_pretrained(make(arch), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, kf(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-6)
    # and back again: the same kfused adapter
    again = kfused.from_peft(back, backend="reference")
    for n, p in kf.named_parameters():
        if p.requires_grad:
            assert torch.equal(again.get_parameter(n), p), n


# ------------------------------------------------------------------------------------------
# refusals: clear messages, nothing changed, nothing overwritten


@pytest.mark.parametrize("arch,cfg,match", [
    ("gpt2", PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM",
                                prefix_projection=True, encoder_hidden_size=16),
     "prefix_projection"),
    ("llama", PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM"),
     "grouped-query"),
    ("llama", IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
     "'IA3' has no kfused equivalent"),
    ("llama", LoraConfig(target_modules=["q_proj"], use_dora=True), "use_dora"),
    ("llama", LoraConfig(target_modules=["q_proj", "embed_tokens"]), "'model.embed_tokens'"),
    ("llama", LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]),
     "modules_to_save"),
    ("roberta", LoKrConfig(target_modules=["query"], rank_dropout=0.1), "rank_dropout"),
    ("llama", LoraConfig(target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 3}),
     "one alpha"),
])
def test_from_peft_refuses_before_changing(arch, cfg, match):
    pm = _peft_model(arch, cfg)
    before = _state(pm)
    with pytest.raises(PeftConversionError, match=match):
        kfused.from_peft(pm)
    _assert_unchanged(pm, before)
    assert getattr(pm.base_model, "kfused_state", None) is None


def test_from_peft_folder_refusal_leaves_model_alone(tmp_path):
    pm = _peft_model("roberta", LoKrConfig(target_modules=["query"], module_dropout=0.2))
    pm.save_pretrained(tmp_path / "a")
    model = make("roberta")
    before = _state(model)
    with pytest.raises(PeftConversionError, match="module_dropout"):
        kfused.from_peft(model, tmp_path / "a")
    _assert_unchanged(model, before)


def _assert_untouched(model, before, grads):
    _assert_unchanged(model, before)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert not hasattr(model, "peft_config")


@pytest.mark.parametrize("cfg,match", [
    (LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
     r"'model.layers.0.self_attn.q_proj'.*lora_A.*\(4, 64\).*\(4, 32\)"),
    (LoKrConfig(r=8, target_modules=["v_proj"]),
     r"'model.layers.0.self_attn.v_proj'.*\(32, 64\).*\(16, 32\)"),
], ids=["lora", "lokr"])
def test_from_peft_folder_for_other_width_refused_before_changing(cfg, match, tmp_path):
    """A folder saved from a wider model: PeftConversionError naming the module, the saved
    shape and the expected one, before PEFT injects anything."""
    _peft_model("llama", cfg, d_model=64).save_pretrained(tmp_path / "wide")
    model = make("llama", d_model=32)
    before, grads = _state(model), {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(PeftConversionError, match=match):
        kfused.from_peft(model, tmp_path / "wide")
    _assert_untouched(model, before, grads)


def test_from_peft_folder_load_failure_restores_model(tmp_path):
    """A folder that passes the checks but that PEFT still cannot load (here its config's rank
    disagrees with the saved factors): PeftConversionError, and the model is put back exactly
    as it was (layers, requires_grad, no peft_config)."""
    _peft_model("llama", LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "a")
    meta = json.load(open(tmp_path / "a" / "adapter_config.json"))
    meta["r"] = 8
    json.dump(meta, open(tmp_path / "a" / "adapter_config.json", "w"))
    model = make("llama")
    before, grads = _state(model), {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(PeftConversionError, match="restored"):
        kfused.from_peft(model, tmp_path / "a")
    _assert_untouched(model, before, grads)
    # the model is usable as before: a good folder converts onto it
    _peft_model("llama", _lora_cfg("llama")).save_pretrained(tmp_path / "b")
    kf = kfused.from_peft(model, tmp_path / "b", backend="reference")
    assert len(kfused.integration.adapter_modules(kf)) == 4


@pytest.mark.parametrize("arch,cfg,match", [
    ("gpt2", AdapterConfig(method="krona"), "Conv1D"),
    ("llama", AdapterConfig(method="parallel_adapter", r=4), "no PEFT equivalent"),
    ("llama", AdapterConfig(method="krona_b"), "no PEFT equivalent"),
    ("gpt2", AdapterConfig(method="prefix", r=3), "positions"),
    ("llama", AdapterConfig(method="krona", targets=["q"], a_shape=(8, 2)),
     "no single PEFT LoKr decompose_factor"),
    # the tiny Llama has 2 kv heads for 4 query heads: the export was written, and PEFT's
    # from_pretrained failed on its size (one prefix per kv head)
    ("llama", AdapterConfig(method="prefix", r=3, options={"position_offset": 3}),
     r"grouped-query model \(2 key/value heads for 4 query heads\).*PEFT could not load it"),
])
def test_to_peft_refuses(arch, cfg, match, tmp_path):
    kf = kfused.inject(make(arch), cfg.replace(backend="reference"))
    with pytest.raises(PeftConversionError, match=match):
        kfused.to_peft(kf, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_to_peft_never_clobbers_foreign_files(tmp_path):
    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", backend="reference"))
    f = tmp_path / "file"
    f.write_text("mine")
    with pytest.raises(FileExistsError, match="not a folder"):
        kfused.to_peft(kf, f)
    assert f.read_text() == "mine"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="did not write"):
        kfused.to_peft(kf, d)
    assert os.listdir(d) == ["notes.txt"]
    # its own output may be replaced ...
    out = kfused.to_peft(kf, tmp_path / "ours")
    assert kfused.to_peft(kf, out) == out
    # ... but not once someone changed or added a file
    (tmp_path / "ours" / "extra.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="extra.bin"):
        kfused.to_peft(kf, out)
    os.remove(tmp_path / "ours" / "extra.bin")
    with open(os.path.join(out, "adapter_config.json"), "a") as fh:
        fh.write(" ")
    with pytest.raises(FileExistsError, match="changed since"):
        kfused.to_peft(kf, out)
    assert (tmp_path / "ours" / "adapter_config.json").read_text().endswith(" ")
    # a damaged marker, or one of its names now a folder: refused by name, nothing replaced
    other = kfused.to_peft(kf, tmp_path / "other")
    (tmp_path / "other" / "kfused_export.json").write_text('{"files": []}')
    with pytest.raises(FileExistsError, match="unreadable"):
        kfused.to_peft(kf, other)
    os.remove(tmp_path / "other" / "adapter_config.json")
    (tmp_path / "other" / "adapter_config.json").mkdir()
    kfused.to_peft(kf, tmp_path / "third")
    os.replace(tmp_path / "third" / "kfused_export.json",
               tmp_path / "other" / "kfused_export.json")
    with pytest.raises(FileExistsError, match="changed since"):
        kfused.to_peft(kf, other)
    assert (tmp_path / "other" / "adapter_config.json").is_dir()


def _folder_bytes(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.mark.parametrize("how", ["swap fails", "rename in fails", "rename back fails too"])
def test_to_peft_failed_replace_keeps_previous_export(how, tmp_path, monkeypatch):
    """Replacing an earlier export: whatever step of the final swap fails, the previous export
    is still complete at the path (or, if even putting it back fails, at the place the error
    names), and the new one never half-replaces it."""
    import kfused.integration.peft_interop as pi

    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", init="random",
                                                    backend="reference"))
    out = kfused.to_peft(kf, tmp_path / "p")
    old = _folder_bytes(out)
    with torch.no_grad():
        next(p for p in kf.parameters() if p.requires_grad).add_(1.0)
    real_replace = os.replace

    def boom(*args, **kwargs):
        raise OSError("simulated: disk full")

    if how == "swap fails":  # the atomic exchange (Linux) and the plain rename both fail
        monkeypatch.setattr(pi, "_exchange", boom, raising=False)
        monkeypatch.setattr(pi.os, "replace", boom)
    else:  # no atomic exchange: the old folder is moved aside, the new one renamed in
        monkeypatch.setattr(pi, "_exchange", lambda a, b: False, raising=False)

        def replace(src, dst):
            if os.fspath(src) != out:  # moving the old export aside works; the rest fails
                if how == "rename back fails too" or ".tmp-" in os.path.basename(src):
                    raise OSError("simulated: disk full")
            return real_replace(src, dst)

        monkeypatch.setattr(pi.os, "replace", replace)
    with pytest.raises(OSError, match="simulated") as err:
        kfused.to_peft(kf, out)
    monkeypatch.undo()
    if how == "rename back fails too":
        assert not os.path.exists(out)
        kept = [n for n in os.listdir(tmp_path) if n in str(err.value)]
        assert len(kept) == 1, (str(err.value), os.listdir(tmp_path))
        assert _folder_bytes(tmp_path / kept[0]) == old
        return
    assert _folder_bytes(out) == old
    assert os.listdir(tmp_path) == ["p"]  # no temporary folder left behind
    # and a later export replaces it completely
    assert kfused.to_peft(kf, out) == out
    new = _folder_bytes(out)
    assert new.keys() == old.keys() and new != old
    assert os.listdir(tmp_path) == ["p"]


def test_to_peft_replaces_previous_export_without_atomic_exchange(tmp_path, monkeypatch):
    """Where the platform cannot swap two folders atomically, the old export is moved aside,
    the new one renamed in, then the old one removed: the result is the new export alone."""
    import kfused.integration.peft_interop as pi

    monkeypatch.setattr(pi, "_exchange", lambda a, b: False, raising=False)
    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", init="random",
                                                    backend="reference"))
    out = kfused.to_peft(kf, tmp_path / "p")
    with torch.no_grad():
        next(p for p in kf.parameters() if p.requires_grad).add_(1.0)
    want = _folder_bytes(kfused.to_peft(kf, tmp_path / "fresh"))
    got = _folder_bytes(kfused.to_peft(kf, out))
    assert got[PEFT_WEIGHTS] == want[PEFT_WEIGHTS] and got.keys() == want.keys()
    assert sorted(os.listdir(tmp_path)) == ["fresh", "p"]


@pytest.mark.parametrize("atomic", [True, False])
def test_to_peft_into_the_current_directory(atomic, tmp_path, monkeypatch):
    """to_peft(model, ".") from inside an empty folder or an earlier export: the export is
    written there and the process's working directory is the new folder, not a removed one."""
    import kfused.integration.peft_interop as pi

    if not atomic:
        monkeypatch.setattr(pi, "_exchange", lambda a, b: False, raising=False)
    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", init="random",
                                                    backend="reference"))
    (tmp_path / "p").mkdir()
    monkeypatch.chdir(tmp_path / "p")
    for _ in range(2):  # an empty folder, then the export written the first time
        out = kfused.to_peft(kf, ".")
        assert out == os.getcwd() == str(tmp_path / "p")
        assert sorted(os.listdir(".")) == ["adapter_config.json", "adapter_model.safetensors",
                                           "kfused_export.json"]
        with torch.no_grad():
            next(p for p in kf.parameters() if p.requires_grad).add_(1.0)
    assert os.listdir(tmp_path) == ["p"]


def test_to_peft_refuses_symlinked_target(tmp_path):
    """A symlink at the path is refused (ValueError naming it) before anything is written; the
    export it points to and the link stay as they were."""
    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", init="random",
                                                    backend="reference"))
    real = kfused.to_peft(kf, tmp_path / "real")
    old = _folder_bytes(real)
    link = tmp_path / "link"
    os.symlink(real, link)
    with pytest.raises(ValueError, match=r"'.*link'.*symbolic link"):
        kfused.to_peft(kf, link)
    assert os.path.islink(link) and os.readlink(link) == real
    assert _folder_bytes(real) == old
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(ValueError, match="symbolic link"):
        kfused.to_peft(kf, dangling)
    assert os.path.islink(dangling) and not os.path.exists(tmp_path / "nowhere")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "link", "real"]


def test_to_peft_refuses_merged(tmp_path):
    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", backend="reference"))
    kfused.merge(kf)
    with pytest.raises(PeftConversionError, match="unmerge"):
        kfused.to_peft(kf, tmp_path / "p")


def test_from_peft_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="PeftModel"):
        kfused.from_peft(make("llama"))
    with pytest.raises(FileNotFoundError):
        kfused.from_peft(make("llama"), str(tmp_path / "missing"))
    # PEFT saves an adapter named other than "default" in a subfolder of that name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(make("llama"), _lora_cfg("llama"), adapter_name="mine").save_pretrained(
            tmp_path / "named")
    assert os.path.isfile(tmp_path / "named" / "mine" / "adapter_config.json")
    with pytest.raises(PeftConversionError, match=r"no adapter_config\.json.*\['mine'\]"):
        kfused.from_peft(make("llama"), str(tmp_path / "named"))
    assert isinstance(kfused.from_peft(make("llama"), str(tmp_path / "named" / "mine"),
                                       backend="reference").model.layers[0].self_attn.q_proj,
                      LoRALinear)
    # a kfused checkpoint (or its version folder) is not a PEFT folder: say what reads it
    kfused.save(kfused.inject(make("llama"), AdapterConfig(method="lora")), tmp_path / "ck")
    version = next(n for n in os.listdir(tmp_path / "ck") if n.startswith("kfused_checkpoint-"))
    for folder in (tmp_path / "ck", tmp_path / "ck" / version):
        model = make("llama")
        before = _state(model)
        with pytest.raises(PeftConversionError, match=r"kfused checkpoint.*kfused\.load"):
            kfused.from_peft(model, str(folder))
        _assert_unchanged(model, before)


def test_from_peft_result_holds_no_peft_record(tmp_path):
    """The converted model no longer carries PEFT's ``model.peft_config`` (PEFT drops it when it
    unloads its layers): after merge_and_unload it is a plain model again, which from_peft
    with an adapter folder takes (it was refused as 'already a PeftModel')."""
    pm = _peft_model("llama", _lora_cfg("llama"))
    pm.save_pretrained(tmp_path / "a")
    ids = batch("llama")["input_ids"]
    kf = kfused.from_peft(pm, backend="reference")
    assert not hasattr(kf, "peft_config")
    plain = kfused.merge_and_unload(kf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "a").eval()
    again = kfused.from_peft(plain, str(tmp_path / "a"), backend="reference").eval()
    assert isinstance(again.model.layers[0].self_attn.q_proj, LoRALinear)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-6)


def test_from_peft_refuses_transformers_loaded_adapters(tmp_path):
    """A transformers model carrying a PEFT adapter through transformers' own integration
    (model.load_adapter) is not a PeftModel: both forms say so and what to call instead (the
    one-argument form said 'cannot find the base model inside LlamaModel'), model unchanged."""
    _peft_model("llama", _lora_cfg("llama")).save_pretrained(tmp_path / "a")
    model = make("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_adapter(str(tmp_path / "a"))
    before = _state(model)
    for args in ((), (str(tmp_path / "a"),)):
        with pytest.raises(TypeError, match=r"load_adapter.*from_peft\(fresh_model"):
            kfused.from_peft(model, *args)
        _assert_unchanged(model, before)


def test_prefix_position_offset_refused_where_positions_differ():
    """The position shift is only offered where positions are arange(past, past + n)."""
    model = make("roberta")
    before = _state(model)
    with pytest.raises(ValueError, match="position_offset"):
        kfused.inject(model, AdapterConfig(method="prefix", r=2, options={"position_offset": 2}))
    _assert_unchanged(model, before)


def test_lokr_per_module_factor_shapes_round_trip(tmp_path):
    """decompose_factor=6 gives q_proj (32->32) A (4, 4) and up_proj (32->96) A (6, 4): no single
    a_shape / b_shape fits, so the shapes are recorded per module; save / load and to_peft keep
    them."""
    cfg = LoKrConfig(target_modules=["q_proj", "up_proj"], r=8, alpha=8, decompose_factor=6,
                     init_weights=False)
    base = make("llama", d_ff=96)
    torch.manual_seed(2)
    pm = get_peft_model(base, cfg).eval()
    ids = batch("llama")["input_ids"]
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    kf = kfused.from_peft(pm, backend="reference").eval()
    shapes = kf.kfused_state.config.options["krona_shapes"]
    assert shapes["model.layers.0.mlp.up_proj"] == [[6, 4], [16, 8]]
    assert shapes["model.layers.0.self_attn.q_proj"] == [[4, 4], [8, 8]]
    with torch.no_grad():
        torch.testing.assert_close(kf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    kfused.save(kf, tmp_path / "kf")
    again = kfused.load(make("llama", d_ff=96), tmp_path / "kf").eval()
    out = kfused.to_peft(again, tmp_path / "peft")
    assert json.load(open(os.path.join(out, "adapter_config.json")))["decompose_factor"] == 6
    back = PeftModel.from_pretrained(make("llama", d_ff=96), out).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, want)


def test_path_arguments_say_what_is_wrong_with_them(tmp_path, monkeypatch):
    # to_peft(m, None) gave os.fspath's "expected str, bytes or os.PathLike object", '<file>/sub'
    # a bare FileExistsError from os.makedirs, and from_peft(model, <file>) "does not exist"
    kf = kfused.inject(make("llama"), AdapterConfig(method="lora", backend="reference"))
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(TypeError, match=r"to_peft: path must be a path \(str or os.PathLike\), "
                                        r"got NoneType None"):
        kfused.to_peft(kf, None)
    with pytest.raises(ValueError, match=r"to_peft: path .*afile/sub.* cannot take the export: "
                                         r".*afile is not a directory"):
        kfused.to_peft(kf, afile / "sub")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="to_peft: path '' names no folder"):
        kfused.to_peft(kf, "")
    with pytest.raises(NotADirectoryError, match=r"from_peft: PEFT adapter folder .*afile' is a "
                                                 r"file, not a folder"):
        kfused.from_peft(make("llama"), str(afile))
    assert sorted(os.listdir(tmp_path)) == ["afile"] and afile.read_text() == "mine"


def test_from_peft_folder_with_saved_layer_weights_says_what_they_are(tmp_path):
    """A PEFT folder that also holds a whole layer's weights (as PEFT saves for a LoRA on a
    tied lm_head, e.g. Gemma's: ``lm_head.base_layer.weight``) is refused, and the message says
    what the tensor is and what to do (it said only 'not a lora factor kfused can convert')."""
    from safetensors.torch import load_file, save_file

    _peft_model("llama", _lora_cfg("llama")).save_pretrained(tmp_path / "a")
    path = str(tmp_path / "a" / "adapter_model.safetensors")
    tensors = load_file(path)
    tensors["base_model.model.lm_head.base_layer.weight"] = torch.zeros(128, 32)
    save_file(tensors, path)
    model = make("llama")
    before = _state(model)
    with pytest.raises(kfused.integration.peft_interop.PeftConversionError,
                       match=r"lm_head.base_layer.weight.*whole layer's weight PEFT saved"
                             r".*save_embedding_layers=False"):
        kfused.from_peft(model, str(tmp_path / "a"))
    _assert_unchanged(model, before)
