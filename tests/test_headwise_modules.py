"""Headwise adapter modules: Triton vs reference through the modules, exact merge/unmerge on
tiny Hugging Face GPT-2, RoBERTa/BERT and Llama (GQA) models built offline, presets, inits
and configuration errors."""

import pytest
import torch
from torch import nn

from conftest import DEVICE
from kfused.integration.headwise import HEADWISE_PRESETS as PRESETS
from kfused.integration.headwise import adapter_parameters, attach_headwise
from kfused.integration.headwise import headwise_parameter_count as count_parameters
from kfused.integration.headwise import headwise_preset as preset
from kfused.integration.headwise import mark_only_adapters_trainable, preset_table
from kfused.modules.headwise import (HeadwiseConfig, HeadwiseOutput, HeadwiseProjection,
                                     HeadwiseQKV, ProjRanks)
from kfused.testing import assert_against_reference

transformers = pytest.importorskip("transformers")

MIX = HeadwiseConfig(q=ProjRanks(wise=2, lite=1, shared=3), v=ProjRanks(lite=2, shared=1),
                     o=ProjRanks(wise=1, shared=2), init="paper", scale=0.5)


def tiny(kind):
    t = transformers
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=30, n_layer=2, n_head=3, vocab_size=40,
                                              n_positions=16))
    if kind == "roberta":
        return t.RobertaModel(t.RobertaConfig(hidden_size=30, num_hidden_layers=2,
                                              num_attention_heads=3, intermediate_size=20,
                                              vocab_size=40, max_position_embeddings=20))
    if kind == "bert":
        return t.BertModel(t.BertConfig(hidden_size=30, num_hidden_layers=1,
                                        num_attention_heads=5, intermediate_size=20,
                                        vocab_size=40, max_position_embeddings=20))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=24, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=20, vocab_size=40,
                                                max_position_embeddings=20))
    raise ValueError(kind)


def _out(model, ids):
    o = model(ids)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


EXPECTED = {"gpt2": 4, "roberta": 6, "bert": 3, "llama": 6}


@pytest.mark.parametrize("kind", ["gpt2", "roberta", "bert", "llama"])
def test_hf_merge_unmerge_exact_float64(kind):
    model = tiny(kind).double().eval()
    ids = torch.randint(3, 40, (2, 7))
    with torch.no_grad():
        frozen = _out(model, ids)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    replaced = attach_headwise(model, MIX)
    assert len(replaced) == EXPECTED[kind]
    n = mark_only_adapters_trainable(model)
    assert n == sum(p.numel() for p in adapter_parameters(model)) > 0
    with torch.no_grad():
        adapted = _out(model, ids)
        assert (adapted - frozen).abs().max() > 1e-6  # the "paper" init is not a no-op
        for m in replaced.values():
            m.merge()
        merged = _out(model, ids)
        for m in replaced.values():
            m.unmerge()
        back = _out(model, ids)
    torch.testing.assert_close(merged, adapted, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(back, adapted, rtol=1e-12, atol=1e-12)
    # The frozen weights are restored (float64 round trip).
    for name, mod in replaced.items():
        base = mod.fused if isinstance(mod, HeadwiseQKV) and mod.fused is not None else \
            getattr(mod, "base", None)
        if base is not None:
            key = f"{name}.weight"
            torch.testing.assert_close(base.weight, state[key], rtol=0, atol=1e-13)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_triton_matches_reference_with_grads(kind):
    # Every adapter module of a model, on the very input the model feeds it (captured from the
    # float64 model): Triton path vs the module's float64 reference path, output, input
    # gradient and every adapter gradient, under the docs/math.md §4 rule, in float16 (the
    # kernels keep float32 intermediates where the float16 reference rounds them; float32 is
    # covered op by op in test_headwise_ops). The rule is applied per module, as the contract
    # defines it per kernel: applied to the gradients of a whole float16 model, each
    # comparison also carried the float16 noise of every unadapted layer, and about 35 such
    # per-tensor comparisons per run made this test flake (seed 1775039852: one element at
    # 1.27x the bound where torch's own float16 error was unusually small; over 14 other seeds
    # the kernel/torch error ratio had a median of 0.93 — the kernels were never less accurate).
    model = tiny(kind).eval()
    replaced = attach_headwise(model, MIX)
    mark_only_adapters_trainable(model)
    ids = torch.randint(3, 40, (2, 9))
    captured = {}

    def keep(name):
        def hook(mod, args, out):         # returns None: the module's output is unchanged
            captured.setdefault(name, args[0].detach())
        return hook

    hooks = [m.register_forward_hook(keep(name)) for name, m in replaced.items()]
    model.double()
    with torch.no_grad():
        _with_backend("reference", lambda: _out(model, ids))
    for h in hooks:
        h.remove()
    assert set(captured) == set(replaced) and len(replaced) == EXPECTED[kind]
    for name, mod in replaced.items():
        params = {n: p.detach().double() for n, p in mod.named_parameters() if p.requires_grad}

        def run(backend, mod=mod):
            def fn(x, **kw):
                model.to(device=x.device, dtype=x.dtype)  # frozen weights in the run's dtype
                with _swap(mod, kw):
                    return _with_backend(backend, lambda: mod(x))
            return fn

        assert_against_reference(run("triton"), run("reference"),
                                 {"x": captured[name], **params}, torch.float16, DEVICE)


def _with_backend(name, fn):
    import os

    old = os.environ.get("KFUSED_BACKEND")
    os.environ["KFUSED_BACKEND"] = name
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("KFUSED_BACKEND")
        else:
            os.environ["KFUSED_BACKEND"] = old


class _swap:
    """Temporarily replace named parameters by given tensors (keeps autograd to them)."""

    def __init__(self, model, tensors):
        self.model, self.tensors, self.saved = model, tensors, {}

    def __enter__(self):
        for name, t in self.tensors.items():
            mod_name, _, attr = name.rpartition(".")
            mod = self.model.get_submodule(mod_name)
            self.saved[name] = mod._parameters[attr]
            mod._parameters[attr] = t
        return self

    def __exit__(self, *exc):
        for name, p in self.saved.items():
            mod_name, _, attr = name.rpartition(".")
            self.model.get_submodule(mod_name)._parameters[attr] = p


def test_modules_standalone_and_lora_init_is_exact():
    torch.manual_seed(0)
    d, H, p = 20, 4, 5
    q, k, v, o = (nn.Linear(d, H * p).double() for _ in range(4))
    o = nn.Linear(H * p, d).double()
    x = torch.randn(3, 6, d, dtype=torch.float64)
    qkv = HeadwiseQKV(q=q, k=k, v=v, n_heads=H, q_ranks=ProjRanks(wise=1, shared=2),
                      v_ranks=ProjRanks(lite=1))
    out = HeadwiseOutput(o, H, ProjRanks(wise=2, shared=1))
    proj = HeadwiseProjection(q, H, ProjRanks(lite=3), key=k)
    Q, K, V = qkv.forward_split(x)
    # init="lora": B = 0 and c = 0, so every module starts exactly at the frozen projection.
    torch.testing.assert_close(Q, q(x), rtol=0, atol=0)
    torch.testing.assert_close(V, v(x), rtol=0, atol=0)
    torch.testing.assert_close(qkv(x), torch.cat([q(x), k(x), v(x)], -1), rtol=0, atol=0)
    torch.testing.assert_close(proj(x), q(x), rtol=0, atol=0)
    torch.testing.assert_close(out(Q), o(Q), rtol=0, atol=0)
    # A starts kaiming-uniform(a=√5) per head: bound 1/sqrt(fan_in).
    A = qkv.q_adapter.wise_A
    assert A.abs().max() <= 1 / d ** 0.5 and A.std() > 0.2 / d ** 0.5
    # Paper init: fmod(randn, 2) * 0.01 everywhere.
    proj.adapter.reset_parameters("paper")
    assert proj.adapter.lite_B.abs().max() <= 0.02 and proj.adapter.lite_B.abs().max() > 0
    assert proj.adapter.c.abs().max() > 0
    # Merge / unmerge of the standalone modules.
    qkv.q_adapter.reset_parameters("paper")
    qkv.v_adapter.reset_parameters("paper")
    with torch.no_grad():
        y = qkv(x)
        qkv.merge()
        torch.testing.assert_close(qkv(x), y, rtol=1e-12, atol=1e-12)
        qkv.unmerge()
        torch.testing.assert_close(qkv(x), y, rtol=1e-12, atol=1e-12)


def _three_modules(d: int, H: int, p: int = 4):
    """Frozen q, k, v, o linears and a HeadwiseQKV, HeadwiseProjection and HeadwiseOutput on
    them, each with random factors of every kind it takes."""
    q, k, v = (nn.Linear(d, H * p).to(DEVICE) for _ in range(3))
    o = nn.Linear(H * p, d).to(DEVICE)
    mods = {"qkv": HeadwiseQKV(q=q, k=k, v=v, n_heads=H, q_ranks=ProjRanks(wise=2, shared=1),
                               v_ranks=ProjRanks(lite=1), init="random"),
            "proj": HeadwiseProjection(q, H, ProjRanks(wise=1, lite=2, shared=1), key=k,
                                       init="random"),
            "out": HeadwiseOutput(o, H, ProjRanks(wise=2, shared=1), init="random")}
    return q, k, v, o, mods


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_modules_under_autocast_run_in_its_dtype(backend):
    # The custom ops are opaque to autocast: the modules cast the activation, the frozen
    # weights and the factors to the autocast dtype themselves (as KronALinear does). Before,
    # a float16 activation (an attention output: what the output projection gets) met float32
    # weights and was refused, and a float32 one ran the whole projection in float32.
    d, H = 12, 3
    q, k, v, o, mods = _three_modules(d, H)
    for name, mod in mods.items():
        for x_dtype in (torch.float32, torch.float16):
            x = torch.randn(2, 5, d, device=DEVICE)
            want = mod(x, backend="reference")
            mod.zero_grad(set_to_none=True)
            with torch.autocast(DEVICE, dtype=torch.float16):
                y = mod(x.to(x_dtype), backend=backend)
            assert y.dtype == torch.float16, (name, x_dtype)
            torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
            y.float().sum().backward()
            grads = [t for t in mod.parameters() if t.requires_grad]
            assert grads and all(t.grad is not None and t.grad.dtype == torch.float32
                                 and t.dtype == torch.float32 for t in grads), (name, x_dtype)
            mod.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lite_modules_compile_fullgraph_with_dynamic_tokens(dtype):
    # A section with lite heads builds its factors in LiteSection, whose kernels were called
    # from the autograd.Function directly: torch.compile failed on them (fullgraph: a graph
    # break on the launcher's data_ptr; without it the CPU interpreter was traced and failed),
    # and the float32 lite gradient looped over the token count (mark_dynamic refused).
    torch._dynamo.reset()
    d, H, p = 12, 2, 6
    q, k, v = (nn.Linear(d, H * p).to(DEVICE, dtype).requires_grad_(False) for _ in range(3))
    mods = (HeadwiseQKV(q=q, k=k, v=v, n_heads=H, q_ranks=ProjRanks(wise=1, shared=1),
                        v_ranks=ProjRanks(lite=2), init="random").to(dtype),
            HeadwiseProjection(q, H, ProjRanks(wise=1, lite=1), key=k, init="random").to(dtype))
    for mod in mods:
        def run(x, mod=mod):
            return mod(x, backend="triton")
        compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
        for n in (3, 5):
            x = torch.randn(2, n, d, device=DEVICE, dtype=dtype)
            torch._dynamo.mark_dynamic(x, 1)
            y = compiled(x)
            y.float().square().sum().backward()
            got = {name: t.grad for name, t in mod.named_parameters() if t.requires_grad}
            mod.zero_grad(set_to_none=True)
            want = run(x)
            want.float().square().sum().backward()
            torch.testing.assert_close(y, want, rtol=0, atol=0)
            for name, t in mod.named_parameters():
                if t.requires_grad:
                    torch.testing.assert_close(got[name], t.grad, rtol=1e-6, atol=1e-6)
            mod.zero_grad(set_to_none=True)


def test_section_ops_opcheck():
    H, Hk, p, d, rw, rl = 4, 2, 3, 7, 2, 1
    kw = dict(device=DEVICE)
    wa, wb = torch.randn(H, rw, d, **kw), torch.randn(H, p, rw, **kw)
    la, lb = torch.randn(H, rl, p, **kw), torch.randn(H, p, rl, **kw)
    wk, bk = torch.randn(Hk * p, d, **kw), torch.randn(Hk * p, **kw)
    for split in (None, torch.float16):
        args = (wa, wb, la, lb, wk, bk, Hk, split)
        torch.library.opcheck(torch.ops.kfused.headwise_section_triton_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))
        down, zb, up = torch.ops.kfused.headwise_section_triton_fwd(*args)
        bargs = (torch.randn_like(down), torch.randn_like(zb), torch.randn_like(up), wa, wb,
                 la, lb, wk, bk, Hk, split is not None, True)
        torch.library.opcheck(torch.ops.kfused.headwise_section_triton_bwd.default, bargs,
                              test_utils=("test_schema", "test_faketensor"))


def test_modules_run_under_inference_mode():
    # The operands packed by a forward for its backward were keyed on the factors' version
    # counters: lite sections (built per call) and factors made under inference_mode are
    # inference tensors, which have none ("Inference tensors do not track version counter").
    d, H, p = 12, 2, 6
    q, k, v, o = (nn.Linear(d, H * p).to(DEVICE).requires_grad_(False) for _ in range(4))
    qkv = HeadwiseQKV(q=q, k=k, v=v, n_heads=H, q_ranks=ProjRanks(wise=1, shared=1),
                      v_ranks=ProjRanks(lite=2), init="random")
    proj = HeadwiseProjection(q, H, ProjRanks(lite=1, shared=1), key=k, init="random")
    x = torch.randn(2, 5, d, device=DEVICE)
    with torch.inference_mode():
        out = HeadwiseOutput(o, H, ProjRanks(wise=2, shared=1), init="random")  # inference
        for mod in (qkv, proj, out):
            torch.testing.assert_close(mod(x, backend="triton"), mod(x, backend="reference"),
                                       rtol=1e-5, atol=1e-5)
    for mod in (qkv, proj):  # training afterwards is unaffected
        y = mod(x, backend="triton")
        y.square().sum().backward()
        got = {n: t.grad for n, t in mod.named_parameters() if t.requires_grad}
        mod.zero_grad(set_to_none=True)
        mod(x, backend="reference").square().sum().backward()
        for n, t in mod.named_parameters():
            if t.requires_grad:
                torch.testing.assert_close(got[n], t.grad, rtol=1e-4, atol=1e-5)


def test_presets_counts_match_modules():
    model = tiny("gpt2")
    d, H, L = 30, 3, 2
    for name, cfg in PRESETS.items():
        m = tiny("gpt2")
        attach_headwise(m, cfg)
        n = mark_only_adapters_trainable(m)
        assert n == count_parameters(cfg, d, H, L), name
    # Paper GPT-2 small numbers (tables 1 and 3): within 0.01 percentage points where the
    # table is reproducible; LoRA-4 and Kernel-mix-lite(qv) small are both 0.118 % here
    # (equal budgets, as the paper says) against the paper's rounded 0.13 %.
    total = 124_439_808
    share = lambda n: 100 * count_parameters(preset(n), 768, 12, 12) / total  # noqa: E731
    assert abs(share("kernel-mix-qvo-intermediate") - 1.61) < 0.01
    assert abs(share("kernel-wise-lite-qv") - 0.13) < 0.01
    assert abs(share("kernel-mix-lite-qv-tiny") - 0.07) < 0.01
    assert share("lora-4") == share("kernel-mix-lite-qv-small")
    assert "kernel-mix-qvo-intermediate" in preset_table()
    del model


def test_gqa_lite_counts_and_shapes():
    m = tiny("llama")
    rep = attach_headwise(m, PRESETS["kernel-mix-qvo-intermediate"])
    vp = rep["model.layers.0.self_attn.v_proj"]
    qp = rep["model.layers.0.self_attn.q_proj"]
    assert vp.n_heads == 2 and qp.n_heads == 4 and qp.n_key_heads == 2
    assert vp.adapter.lite_A.shape == (2, 8, 6)
    n = mark_only_adapters_trainable(m)
    assert n == count_parameters(PRESETS["kernel-mix-qvo-intermediate"], 24, 4, 2,
                                 n_kv_heads=2, head_bias=False)


def test_config_errors():
    with pytest.raises(ValueError, match="o.lite"):
        HeadwiseConfig(o=ProjRanks(lite=1))
    with pytest.raises(ValueError, match="non-negative"):
        ProjRanks(wise=-1)
    with pytest.raises(ValueError, match="init"):
        HeadwiseConfig(init="zeros")
    lin = nn.Linear(12, 10)
    with pytest.raises(ValueError, match="n_heads=3"):
        HeadwiseProjection(lin, 3, ProjRanks(wise=1))
    with pytest.raises(ValueError, match="key"):
        HeadwiseProjection(lin, 2, ProjRanks(lite=1))
    with pytest.raises(ValueError, match="n_key_heads"):
        HeadwiseProjection(lin, 2, ProjRanks(lite=1), key=nn.Linear(12, 15))
    with pytest.raises(ValueError, match="fused"):
        HeadwiseQKV(fused=nn.Linear(12, 30), n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        HeadwiseQKV(q=lin, k=lin, v=lin, n_heads=2, n_kv_heads=3)
    with pytest.raises(ValueError, match="no GPT-2"):
        attach_headwise(nn.Sequential(nn.Linear(4, 4)), HeadwiseConfig(q=ProjRanks(shared=1)))
    with pytest.raises(ValueError, match="unknown preset"):
        preset("lora-5")
    # A per-head bias cannot be merged into a bias-less projection.
    m = HeadwiseProjection(nn.Linear(12, 10, bias=False), 2, ProjRanks(wise=1), head_bias=True)
    with pytest.raises(ValueError, match="no bias"):
        m.merge()


def test_constructor_arguments_are_checked():
    # Probe: n_heads=0 raised ZeroDivisionError, n_kv_heads=0 was taken as n_heads, a str or
    # NaN scale and ProjRanks(wise=True) were accepted. A non-number is a TypeError, a
    # non-finite number or a bad count a ValueError, each naming the argument.
    fused, lin = nn.Linear(12, 36), nn.Linear(12, 12)
    with pytest.raises(ValueError, match=r"n_heads must be a positive int, got 0"):
        HeadwiseQKV(fused=fused, n_heads=0)
    with pytest.raises(ValueError, match=r"n_kv_heads must be a positive int or None, got 0"):
        HeadwiseQKV(fused=fused, n_heads=3, n_kv_heads=0)
    with pytest.raises(ValueError, match=r"n_heads must be a positive int, got 2.0"):
        HeadwiseQKV(fused=fused, n_heads=2.0)
    with pytest.raises(ValueError, match=r"n_key_heads must be a positive int or None, got 0"):
        HeadwiseProjection(lin, 3, ProjRanks(lite=1), key=lin, n_key_heads=0)
    with pytest.raises(ValueError, match=r"n_heads must be a positive int, got True"):
        HeadwiseOutput(lin, True, ProjRanks(wise=1))
    for bad, exc in (("a", TypeError), (None, TypeError), (float("nan"), ValueError),
                     (float("inf"), ValueError)):
        with pytest.raises(exc, match=r"HeadwiseConfig\.scale must be"):
            HeadwiseConfig(scale=bad)
        with pytest.raises(exc, match=r"scale must be"):
            HeadwiseProjection(lin, 3, ProjRanks(shared=1), scale=bad)
        with pytest.raises(exc, match=r"scale must be"):
            HeadwiseOutput(lin, 3, ProjRanks(shared=1), scale=bad)
        with pytest.raises(exc, match=r"scale must be"):
            HeadwiseQKV(fused=fused, n_heads=3, v_ranks=ProjRanks(shared=1), scale=bad)
    with pytest.raises(ValueError, match=r"ProjRanks.wise must be a non-negative int, got True"):
        ProjRanks(wise=True)
    with pytest.raises(TypeError, match=r"HeadwiseConfig.q must be a ProjRanks"):
        HeadwiseConfig(q=(1, 0, 0))
    with pytest.raises(TypeError, match=r"head_bias"):
        HeadwiseConfig(head_bias="yes")
    with pytest.raises(TypeError, match=r"ranks must be a ProjRanks"):
        HeadwiseOutput(lin, 3, {"wise": 1})
    import numpy as np
    assert HeadwiseConfig(scale=np.float32(2.0)).scale == 2.0
    assert HeadwiseQKV(fused=fused, n_heads=3, n_kv_heads=None).n_kv_heads == 3


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_modules_float32_factors_on_half_base_outside_autocast(backend):
    # inject keeps adapter parameters in float32 (AdapterConfig.adapter_dtype's default) on a
    # float16 base; outside autocast the modules refused the float16 activation ("q.shared_A
    # has dtype torch.float32 but x has dtype torch.float16"), while KronALinear and
    # LoRALinear cast their factors to the activation's dtype.
    d, H = 12, 3
    q, k, v, o, mods = _three_modules(d, H)
    for t in (q, k, v, o):
        t.requires_grad_(False)
    for name, mod in mods.items():
        x = torch.randn(2, 5, d, device=DEVICE)
        want = mod(x, backend="reference")
        for base in (q, k, v, o):
            base.half()
        try:
            y = mod(x.half(), backend=backend)
            assert y.dtype == torch.float16, name
            torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
            y.float().sum().backward()
            grads = [t for t in mod.parameters() if t.requires_grad]
            assert grads and all(t.grad is not None and t.grad.dtype == torch.float32
                                 and t.dtype == torch.float32 for t in grads), name
        finally:
            for base in (q, k, v, o):
                base.float()


@pytest.mark.parametrize("kind", ["proj", "out", "qkv"])
def test_refused_merge_leaves_the_module_unchanged(kind):
    # Probe: a per-head bias c on a frozen projection without bias cannot be merged; the
    # refusal came after ΔW had been added to the frozen weight, so the (still unmerged)
    # module applied the update twice from then on.
    d, H = 12, 3
    lin = lambda: nn.Linear(d, d, bias=False).double()  # noqa: E731
    if kind == "proj":
        m = HeadwiseProjection(lin(), H, ProjRanks(wise=2, shared=1), head_bias=True,
                               init="random")
    elif kind == "out":
        m = HeadwiseOutput(lin(), H, ProjRanks(wise=2, shared=1), head_bias=True,
                           init="random")
    else:      # q (no bias term) folds first, then v's c is refused
        m = HeadwiseQKV(q=lin(), k=lin(), v=lin(), n_heads=H, q_ranks=ProjRanks(shared=2),
                        v_ranks=ProjRanks(wise=2), head_bias=True, init="random")
    m.double()
    with torch.no_grad():
        for t in m.parameters():
            if t.requires_grad:
                t.normal_()
    x = torch.randn(4, d, dtype=torch.float64)
    y0 = m(x, backend="reference")
    before = {n: t.clone() for n, t in m.state_dict().items()}
    with pytest.raises(ValueError, match="the frozen projection has no bias"):
        m.merge()
    assert not m.merged
    for n, t in m.state_dict().items():
        assert torch.equal(t, before[n]), n
    torch.testing.assert_close(m(x, backend="reference"), y0, rtol=0, atol=0)


def test_modules_freeze_the_projections_they_wrap():
    """As KronALinear and LoRALinear: optimizer(module.parameters()) trains the adapter alone
    (the headwise modules left their wrapped projections trainable); the flag can be set back
    by hand, and the projection then gets its gradient."""
    d, H = 12, 3
    key = nn.Linear(d, d)
    mods = {"proj": HeadwiseProjection(nn.Linear(d, d), H, ProjRanks(wise=1, lite=1, shared=1),
                                       key=key, init="random"),
            "out": HeadwiseOutput(nn.Linear(d, d), H, ProjRanks(wise=1, shared=1),
                                  init="random"),
            "qkv_fused": HeadwiseQKV(fused=nn.Linear(d, 3 * d), n_heads=H,
                                     q_ranks=ProjRanks(wise=1), v_ranks=ProjRanks(shared=1)),
            "qkv_split": HeadwiseQKV(q=nn.Linear(d, d), k=nn.Linear(d, d), v=nn.Linear(d, d),
                                     n_heads=H, q_ranks=ProjRanks(lite=1))}
    for name, m in mods.items():
        frozen = {n for n, _ in m.named_parameters()
                  if n.startswith(("base.", "fused.", "q.", "k.", "v."))}
        assert frozen, name
        for n, prm in m.named_parameters():
            assert prm.requires_grad == (n not in frozen), (name, n)
    assert key.weight.requires_grad        # not the module's: left as the caller made it
    m = mods["out"]
    m.base.weight.requires_grad_(True)
    m(torch.randn(2, d)).sum().backward()
    assert m.base.weight.grad is not None and m.base.bias.grad is None
