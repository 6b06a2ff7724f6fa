"""state_dict / load_state_dict of the mergeable adapter modules: a state_dict records whether
its frozen weights already hold the update (``<prefix>kfused_merged``, only while merged), so
loading it always gives the module that was saved — never the update applied twice (a merged
dict into a fresh module) or not at all (an unmerged dict into a merged module)."""

import copy

import pytest
import torch
from torch import nn

from kfused.modules import (HeadwiseOutput, HeadwiseProjection, HeadwiseQKV, KronALinear,
                            LoRALinear, ProjRanks)
from kfused.modules._linear import MERGED_KEY

F64 = torch.float64
D, H = 12, 3            # width 12, 3 heads of width 4
KEY = nn.Linear(D, D).double()   # the frozen key projection lite reads (not in any state_dict)


def _randomize(m: nn.Module, seed: int) -> nn.Module:
    """Every parameter (frozen ones too) random: the update and the biases are far from 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


BUILDERS = {
    "krona": lambda: KronALinear(nn.Linear(D, 20), a_shape=(4, 3), scale=0.7, init="random"),
    "lora": lambda: LoRALinear(nn.Linear(D, 20), r=2, alpha=3.0, init="random"),
    "proj": lambda: HeadwiseProjection(nn.Linear(D, D), H, ProjRanks(wise=1, lite=2, shared=1),
                                       key=KEY, scale=0.5, head_bias=True),
    "qkv_fused": lambda: HeadwiseQKV(fused=nn.Linear(D, 3 * D), n_heads=H,
                                     q_ranks=ProjRanks(wise=1, shared=2),
                                     v_ranks=ProjRanks(lite=1), scale=0.5, head_bias=True),
    "qkv_split": lambda: HeadwiseQKV(q=nn.Linear(D, D), k=nn.Linear(D, 4), v=nn.Linear(D, 4),
                                     n_heads=H, n_kv_heads=1, q_ranks=ProjRanks(lite=1),
                                     v_ranks=ProjRanks(wise=2), head_bias=True),
    "output": lambda: HeadwiseOutput(nn.Linear(D, 10), H, ProjRanks(wise=2, shared=1),
                                     scale=0.5, head_bias=True),
}


def build(kind: str, seed: int) -> nn.Module:
    return _randomize(BUILDERS[kind]().double(), seed)


def run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(m, (KronALinear, LoRALinear)):
        m.backend = "reference"
        return m(x)
    return m(x, backend="reference")


X = torch.randn(5, D, dtype=F64, generator=torch.Generator().manual_seed(0))
X_OUT = torch.randn(5, D, dtype=F64, generator=torch.Generator().manual_seed(1))


def _x(kind):
    return X_OUT if kind == "output" else X


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _source(kind, seed):
    """A module of ``kind``, its input and its (unmerged) output."""
    src = build(kind, seed)
    x = _x(kind)
    return src, x, run(src, x)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_merged_state_dict_into_a_fresh_module(kind, strict):
    src, x, y = _source(kind, 1)
    plain_keys = list(src.state_dict().keys())
    assert MERGED_KEY not in "".join(plain_keys)
    src.merge()
    sd = copy.deepcopy(src.state_dict())
    assert sorted(sd) == sorted(plain_keys + [MERGED_KEY])     # one key more, only when merged
    assert sd[MERGED_KEY].dim() == 0 and bool(sd[MERGED_KEY])
    fresh = build(kind, 2)
    assert not fresh.merged
    res = fresh.load_state_dict(sd, strict=strict)
    assert not res.missing_keys and not res.unexpected_keys
    assert fresh.merged                                        # the update is in its weights
    _close(run(fresh, x), y)                                   # not applied twice
    assert MERGED_KEY in sd                                    # the caller's dict is untouched
    fresh.unmerge()
    _close(run(fresh, x), y)
    adapter = [k for k in plain_keys if k.split(".")[0] not in ("base", "fused", "q", "k", "v")]
    assert adapter
    for k in adapter:                                          # the adapter, loaded as saved
        _close(fresh.state_dict()[k], sd[k])


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_unmerged_state_dict_into_a_merged_module(kind, strict):
    src, x, y = _source(kind, 3)
    sd = copy.deepcopy(src.state_dict())
    assert not any(k.endswith(MERGED_KEY) for k in sd)         # today's keys, exactly
    dst = build(kind, 4)
    dst.merge()
    dst.load_state_dict(sd, strict=strict)
    assert not dst.merged                                      # its weights are the plain ones
    _close(run(dst, x), y)
    dst.merge()
    _close(run(dst, x), y)


def test_merged_state_dict_of_a_model_round_trips_and_strict_loading_holds():
    torch.manual_seed(0)

    def model():
        return nn.Sequential(nn.Linear(D, D), build("krona", 5), nn.ReLU(),
                             KronALinear(nn.Linear(20, 8), init="random")).double()

    src = model()
    src[1].merge()                                  # one adapter merged, the other not
    x = torch.randn(4, D, dtype=F64)
    src[1].backend = src[3].backend = "reference"
    y = src(x)
    sd = src.state_dict()
    assert [k for k in sd if k.endswith(MERGED_KEY)] == ["1." + MERGED_KEY]
    dst = model()
    dst.load_state_dict(sd)                         # strict
    assert dst[1].merged and not dst[3].merged
    dst[1].backend = dst[3].backend = "reference"
    _close(dst(x), y)
    # a model without kfused modules refuses the extra key under strict loading
    plain = nn.Sequential(nn.Linear(D, D), nn.Linear(D, 20))
    with pytest.raises(RuntimeError, match="Unexpected key.*kfused_merged"):
        plain.load_state_dict({"0.weight": sd["0.weight"], "0.bias": sd["0.bias"],
                               "1.weight": sd["1.base.weight"], "1.bias": sd["1.base.bias"],
                               "1." + MERGED_KEY: sd["1." + MERGED_KEY]})


def test_adapter_only_load_into_a_merged_module():
    # strict=False with the adapter parameters only: the module keeps its own frozen weights;
    # being merged, it takes its current update out first, so the new factors apply once.
    m = build("krona", 6)
    frozen = copy.deepcopy(m.base)
    m.merge()
    new = build("krona", 7)
    res = m.load_state_dict({"A": new.A.detach(), "B": new.B.detach()}, strict=False)
    assert set(res.missing_keys) == {"base.weight", "base.bias"}
    assert not m.merged
    want = KronALinear(frozen, a_shape=(4, 3), scale=0.7).double()
    with torch.no_grad():
        want.A.copy_(new.A)
        want.B.copy_(new.B)
    _close(run(m, X), run(want, X))
    # a dict that touches nothing of the module leaves it as it is
    m.merge()
    m.load_state_dict({}, strict=False)
    assert m.merged


def test_wrapped_linear_weight_is_the_base_layers_and_ties_through():
    # transformers' tie_weights assigns lm_head.weight = wte.weight: on a wrapped lm_head that
    # registered a second, unused weight beside the base's (or, with the read-only weight
    # property, failed with KeyError "attribute 'weight' already exists")
    from kfused.integration import AdapterConfig, inject
    from kfused.integration.models import tiny_model

    model = tiny_model("gpt2")
    inject(model, AdapterConfig(method="lora", r=2, targets=["lm_head", "c_attn"]))
    head = model.lm_head
    assert head.weight is head.base.weight and "weight" not in head._parameters
    other = torch.nn.Parameter(head.base.weight.detach().clone(), requires_grad=False)
    head.weight = other
    assert head.base.weight is other and head.weight is other
    model.tie_weights()
    assert head.base.weight is model.transformer.wte.weight and "weight" not in head._parameters


@pytest.mark.parametrize("method,options", [("inducer", {}),
                                            ("prefix", {"position_offset": 3})])
def test_whole_injected_model_pickles_and_loads_back(method, options):
    # torch.save(model) / copy by pickling: the hooks inject leaves on the model (the inducer's
    # reader of old state_dict keys, prefix tuning's position offset) were local closures, and
    # pickling failed with "Can't pickle local object"
    import io

    from kfused.integration import AdapterConfig, inject
    from kfused.integration.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", vocab=64, d_model=16, n_heads=2, n_layers=1, max_len=32)
    inject(model, AdapterConfig(method=method, r=2, backend="reference", options=options))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    model.eval()
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, want, rtol=0, atol=0)
    if method == "inducer":      # the loaded model still reads the two-name layout's keys
        sd = model.state_dict()
        old = {k.replace("self_attn.o_proj.adapter.", "self_attn.kfused_inducer."): v
               for k, v in sd.items()}
        assert old.keys() != sd.keys()
        with torch.no_grad():
            for p in back.parameters():
                p.zero_()
        back.load_state_dict(old)
        with torch.no_grad():
            torch.testing.assert_close(back(input_ids=ids).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["qkv_fused", "qkv_split"])
def test_jit_trace_of_a_headwise_module_matches_eager(kind):
    # under torch.jit.trace a size is a tensor: the input-width check looked it up in a set of
    # ints and refused every input ("its last dimension 12 must equal the input width 12")
    m = build(kind, 8).eval()
    x = _x(kind)
    want = run(m, x)
    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, t):
            return self.m(t, backend="reference")

    traced = torch.jit.trace(Call(), (x,), check_trace=False)
    _close(traced(x), want)
    with pytest.raises(ValueError, match="must equal the input width"):
        m(torch.zeros(5, D + 1, dtype=F64), backend="reference")


def test_reset_parameters_repeats_the_modules_init():
    # the meta-device recipe (build on meta, to_empty, reset_parameters() on every module)
    # re-initialised the per-head modules with "zero" whatever init they were built with:
    # an init="random" / "paper" adapter silently started at the frozen model
    torch.manual_seed(0)
    with torch.device("meta"):
        mods = [HeadwiseOutput(nn.Linear(D, 10), H, ProjRanks(wise=2, shared=1), init="random"),
                HeadwiseQKV(fused=nn.Linear(D, 3 * D), n_heads=H, init="paper",
                            q_ranks=ProjRanks(wise=1, shared=2), v_ranks=ProjRanks(wise=1))]
    for m in mods:
        m.to_empty(device="cpu")
        m.apply(lambda s: s.reset_parameters() if hasattr(s, "reset_parameters") else None)
    out, qkv = mods
    for t in (out.wise_B, out.shared_B, qkv.q_adapter.wise_B, qkv.q_adapter.shared_B,
              qkv.q_adapter.c, qkv.v_adapter.c):
        assert t.abs().max() > 0
    assert qkv.q_adapter.c.abs().max() < 0.03          # "paper": fmod(randn, 2)·0.01
    out.reset_parameters("zero")                       # an explicit init still applies
    assert not out.wise_B.any() and not out.shared_B.any()


@pytest.mark.parametrize("kind", ["krona_b", "krona_b_res", "parallel_adapter"])
def test_reset_parameters_sets_every_block_adapter_tensor(kind):
    # Probe: KronABlock's output bias and s_res and the parallel adapter's two biases were
    # set in __init__ only; after the meta-device recipe (to_empty, reset_parameters()) they
    # held uninitialised memory: a "zero" adapter did not start at the frozen block.
    from kfused.modules import KronABlock, ScaledParallelAdapter

    with torch.device("meta"):
        m = (ScaledParallelAdapter(nn.Linear(D, D), D, r=3, init="zero")
             if kind == "parallel_adapter" else
             KronABlock(nn.Linear(D, D), d_in=D, bias=True, residual=kind == "krona_b_res"))
    m.to_empty(device="cpu")
    with torch.no_grad():
        for t in m.parameters():
            t.fill_(float("nan"))      # what uninitialised memory may hold
    m.apply(lambda s: s.reset_parameters() if hasattr(s, "reset_parameters") else None)
    for n, t in m.named_parameters():
        assert torch.isfinite(t).all(), n
    if kind == "parallel_adapter":
        x = torch.randn(4, D)
        torch.testing.assert_close(m(x), m.block(x), rtol=0, atol=0)   # exact start
        assert not m.down_bias.any() and not m.up_bias.any()
    else:
        assert not m.bias.any()
        if kind == "krona_b_res":
            assert m.res_scale.item() == 1.0


def _inducer_logits_module():
    """A module (ids[, mask]) -> logits around a tiny injected inducer Llama in eval."""
    from kfused.integration import AdapterConfig, inject
    from kfused.integration.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", vocab=64, d_model=16, n_heads=2, n_layers=1, max_len=32)
    inject(model, AdapterConfig(method="inducer", r=2, backend="reference"))
    model.eval()

    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, mask=None):
            return self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits

    return Call()


def test_export_of_an_inducer_model_with_an_attention_mask():
    # torch.export of an injected inducer model given an attention mask failed inside kfused's
    # mask function (bool() of "every key unpadded" is data-dependent: GuardOnDataDependent-
    # SymNode); the mask is kept there instead, and the exported model equals the eager one
    call = _inducer_logits_module()
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    exported = torch.export.export(call, (ids, torch.ones_like(ids))).module()
    for mask in (torch.ones_like(ids), torch.tensor([[1] * 7, [0, 0] + [1] * 5])):
        with torch.no_grad():
            torch.testing.assert_close(exported(ids, mask), call(ids, mask),
                                       rtol=1e-6, atol=1e-6)


def test_export_of_an_inducer_model_without_an_attention_mask_says_what_to_pass():
    # without a mask transformers marks a traced batch as packed sequences (it cannot read the
    # position ids under tracing): the export failed deep inside with an obscure
    # GuardOnDataDependentSymNode. It now says so and what to pass instead
    call = _inducer_logits_module()
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NotImplementedError, match="attention_mask=torch.ones_like"):
        torch.export.export(call, (ids,))
    with torch.no_grad():                                # eager runs as before
        assert torch.isfinite(call(ids)).all()
