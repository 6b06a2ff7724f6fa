"""InducerAttention adapter and the transformers AttentionInterface registration."""

import pytest
import torch

from tests.conftest import DEVICE
from kfused.backends import available_backends
from kfused.modules.inducer import InducerAttention, InducerOutputProjection
from kfused.ops import inducer_attention, inducer_output_projection

transformers = pytest.importorskip("transformers")
from kfused.integration import hf_attention  # noqa: E402


def test_zero_init_is_exact_and_paper_init_small():
    H, p, d = 2, 32, 48
    ad = InducerAttention(H, p, d_model=d, key_bottleneck=3, value_bottleneck=5, init="zero")
    q, k, v = (torch.randn(2, H, 7, p) for _ in range(3))
    f, u = ad(q, k, v, causal=True, backend="reference")
    assert u.shape == (2, H, 7, 5)
    W_o, b_o = torch.randn(d, H * p), torch.randn(d)
    y = ad.output_projection(f, u, W_o, b_o)
    frozen = f.transpose(1, 2).reshape(2, 7, H * p) @ W_o.t() + b_o
    torch.testing.assert_close(y, frozen)
    ad2 = InducerAttention(H, p, d_model=d, init="paper")
    for name in ("Ak", "ak", "Bk", "ck", "W1", "b1", "W2", "b2"):
        t = getattr(ad2, name)
        assert 0 < t.abs().max() <= 0.02 + 1e-6
    # the fused output weight equals the reference projection
    f2, u2 = ad2(q, k, v, backend="reference")
    y2 = ad2.output_projection(f2, u2, W_o, b_o)
    ref = (f2.transpose(1, 2).reshape(2, 7, H * p) @ W_o.t() + b_o
           + u2.transpose(1, 2).reshape(2, 7, -1) @ ad2.W2.reshape(-1, d) + ad2.b2)
    torch.testing.assert_close(y2, ref)


def test_gate_and_prefix_module():
    H, p = 2, 32
    ad = InducerAttention(H, p, composition="gate", prefix_len=4, key_bottleneck=2,
                          value_bottleneck=3)
    assert ad.W2.shape == (H, 3, p) and ad.prefix_k.shape == (H, 4, p)
    q, k, v = (torch.randn(1, H, 9, p) for _ in range(3))
    out, u = ad(q, k, v, backend="reference")
    assert u is None and out.shape == q.shape
    out.sum().backward()
    assert ad.prefix_k.grad is not None and ad.Ak.grad is not None
    pre = InducerAttention(H, p, prefix_len=3, inducer=False)
    out, u = pre(q, k, v, backend="reference")
    assert u is None and not hasattr(pre, "Ak")
    with pytest.raises(ValueError, match="composition"):
        InducerAttention(H, p, composition="mul")
    with pytest.raises(ValueError, match="init"):
        InducerAttention(H, p, init="lora")


def test_query_hook():
    H, p = 1, 32
    ad = InducerAttention(H, p, inducer=False)
    ad.query_hook = lambda q: q * 0
    q, k, v = (torch.randn(1, H, 5, p) for _ in range(3))
    out, _ = ad(q, k, v, backend="reference")
    torch.testing.assert_close(out, v.mean(2, keepdim=True).expand_as(out))


def _tiny(kind):
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_head=2, n_layer=2, vocab_size=50,
                                      n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                                      embd_pdrop=0.0)
        return transformers.GPT2Model(cfg)
    if kind == "roberta":
        cfg = transformers.RobertaConfig(hidden_size=64, num_attention_heads=2,
                                         num_hidden_layers=2, intermediate_size=96,
                                         vocab_size=50, max_position_embeddings=80,
                                         attention_probs_dropout_prob=0.0,
                                         hidden_dropout_prob=0.0)
        return transformers.RobertaModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                   num_hidden_layers=2, intermediate_size=96, vocab_size=50,
                                   max_position_embeddings=64)
    return transformers.LlamaModel(cfg)


def _inputs(kind):
    ids = torch.randint(3, 50, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    if kind == "llama" or kind == "gpt2":
        mask[1, :4] = 0          # left padding for decoders
    else:
        mask[1, 7:] = 0          # right padding for the encoder
    return ids, mask


@pytest.mark.parametrize("kind", ["gpt2", "roberta", "llama"])
def test_hf_plain_matches_sdpa_with_padding(kind):
    torch.manual_seed(0)
    model = _tiny(kind).to(DEVICE).eval()         # (compiled Triton takes CUDA tensors only)
    ids, mask = (t.to(DEVICE) for t in _inputs(kind))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    hf_attention.set_implementation(model)
    if DEVICE == "cuda" or _interp():       # run the Triton kernel (interpreter on CPU)
        for attn, *_ in hf_attention.attention_layers(model):
            attn.kfused_backend = "triton" if DEVICE == "cuda" or _interp() else None
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)


def _interp():
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.parametrize("kind", ["gpt2", "roberta", "llama"])
def test_hf_zero_init_inducer_starts_at_frozen_model(kind):
    torch.manual_seed(0)
    model = _tiny(kind).eval()
    ids, mask = _inputs(kind)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    adapters = hf_attention.add_inducers(model, key_bottleneck=2, value_bottleneck=3,
                                         init="zero")
    assert len(adapters) == 2
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)
    out[keep].sum().backward()
    assert all(a.W2.grad is not None and a.W2.grad.abs().sum() > 0 for a in adapters)
    assert any(isinstance(m, InducerOutputProjection) for m in model.modules())
    # with a non-zero W2 the output moves
    with torch.no_grad():
        for a in adapters:
            a.W2.normal_()
    out2 = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (out2[keep] - ref[keep]).abs().max() > 1e-3


def test_hf_padding_not_dropped():
    """Changing a padded token must not change the real tokens' outputs."""
    torch.manual_seed(0)
    model = _tiny("roberta").eval()
    hf_attention.add_inducers(model, key_bottleneck=2, value_bottleneck=3, prefix_len=2)
    ids, mask = _inputs("roberta")
    ids2 = ids.clone()
    ids2[1, 8] = (ids2[1, 8] + 1) % 50
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).last_hidden_state
        b = model(input_ids=ids2, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(a[1, :7], b[1, :7])


def test_mask_function_refuses_unsupported_patterns():
    from transformers import masking_utils as mu

    with pytest.raises(NotImplementedError, match="sliding"):
        hf_attention.kfused_inducer_mask(
            1, 4, 4, mask_function=mu.sliding_window_causal_mask_function(2),
            attention_mask=torch.ones(1, 4, dtype=torch.bool))
    m = torch.tensor([[1, 1, 0, 1]])
    out = hf_attention.kfused_inducer_mask(1, 4, 4, mask_function=mu.causal_mask_function,
                                           attention_mask=m)
    assert out.dtype == torch.bool and out.tolist() == [[True, True, False, True]]
    assert hf_attention.kfused_inducer_mask(1, 4, 4, attention_mask=torch.ones(1, 4)) is None
    if not hasattr(mu, "packed_sequence_compatibility_function"):
        return                     # an older transformers builds no packed-sequence mask
    # transformers' packed-sequence mask over a causal base -> the packed lengths; with any
    # other pattern combined (a sliding window) it is refused, not dropped
    segs, pos = torch.tensor([[0, 0, 1, 1, 1, 2]]), torch.tensor([[0, 1, 0, 1, 2, 0]])
    packed = hf_attention.kfused_inducer_mask(1, 6, 6, mask_function=(
        mu.packed_sequence_compatibility_function(mu.causal_mask_function, pos, segs)))
    assert isinstance(packed, hf_attention.PackedSequences) and packed.causal
    cu, longest = packed.cu_seqlens()
    assert cu.tolist() == [0, 2, 5, 6] and longest == 3
    with pytest.raises(NotImplementedError, match="sliding"):
        hf_attention.kfused_inducer_mask(1, 6, 6, mask_function=(
            mu.packed_sequence_compatibility_function(
                mu.sliding_window_causal_mask_function(2), pos, segs)))
    with pytest.raises(ValueError, match="2-D key padding mask"):
        q = torch.randn(1, 1, 4, 32)
        hf_attention.kfused_inducer_attention_forward(torch.nn.Module(), q, q, q,
                                                      torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_bench_cases_build():
    from kfused.cases.inducer import bench_cases as cases

    cs = cases("cpu", torch.float32, quick=True)
    assert cs and {p.name for p in cs[0].providers} == {"kfused-triton", "kfused-cuda", "sdpa",
                                                         "sdpa-default", "flex", "eager",
                                                         "compile"}
    # the CUDA C++ provider is skipped with its reason where the extension is not built
    cu = next(p for p in cs[0].providers if p.name == "kfused-cuda")
    assert (cu.skip_reason is None) == (available_backends("inducer_attention", "cpu",
                                                           torch.float32)["cuda"] is None)
    decode = [c for c in cs if c.shape.get("decode")]
    assert decode and all("kfused-cuda" in {p.name for p in c.providers} for c in decode)
    fn, leaves = next(p for p in cs[0].providers if p.name == "sdpa").make()
    assert fn().shape[-1] == 64 and len(leaves) == 3
    assert cs[0].shape["n"] <= 128                 # CPU cases stay interpreter-sized


def test_hf_generate_with_kv_cache_matches_sdpa():
    """Decoding against a KV cache (n_q = 1, bottom-right causal) with a zero-init inducer."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny("llama").config).eval()
    ids = torch.randint(3, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    model.set_attn_implementation("sdpa")
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    hf_attention.add_inducers(model.model, key_bottleneck=2, value_bottleneck=3, init="zero")
    hf_attention.set_implementation(model)
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)


def test_packed_mask_recognised_in_either_order():
    """transformers composes its packed-sequence mask as and_masks of the segment mask and the
    position remap — remap first since 5.x, segments first before: both are recognised, with
    the segments and the base mask function; anything more (a third part, an or-overlay) is
    not (and so refused by the mask interface)."""
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "packed_sequence_mask_function"):
        pytest.skip("this transformers has no packed-sequence masks")
    from kfused.integration.hf_attention import packed_segments

    seg = torch.tensor([[0, 0, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    s_fn = mu.packed_sequence_mask_function(seg)
    r_fn = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos)
    for parts in ((s_fn, r_fn), (r_fn, s_fn)):
        got = packed_segments(mu.and_masks(*parts))
        assert got is not None and got[0] is seg and got[1] is mu.causal_mask_function
    assert packed_segments(mu.and_masks(s_fn, r_fn, s_fn)) is None
    assert packed_segments(mu.or_masks(s_fn, r_fn)) is None
    assert packed_segments(mu.and_masks(s_fn, s_fn)) is None
    assert packed_segments(mu.causal_mask_function) is None


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_packed_sequences_match_padded_batch(kind, monkeypatch):
    """Padding-free training (transformers' packed format: one row, position_ids restarting
    at each sequence, no attention mask): the packed varlen kernels give each sequence what
    the padded batch gives it, outputs and adapter gradients, and attend across no sequence
    boundary."""
    torch.manual_seed(0)
    model = _tiny(kind).eval()
    adapters = hf_attention.add_inducers(model, key_bottleneck=2, value_bottleneck=3,
                                         prefix_len=2)
    lens = [5, 9, 3]
    n = max(lens)
    ids = torch.randint(3, 50, (len(lens), n))
    mask = (torch.arange(n)[None, :] < torch.tensor(lens)[:, None]).long()   # right padding
    calls = []
    real = hf_attention.inducer_attention_varlen
    monkeypatch.setattr(hf_attention, "inducer_attention_varlen",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(hf_attention.InducerAttention, "forward", _count_packed(
        hf_attention.InducerAttention.forward, calls))
    params = [p for a in adapters for p in a.parameters()]
    weights = torch.randn(sum(lens), model.config.hidden_size)

    def run(**inputs):
        return model(**inputs).last_hidden_state

    padded = run(input_ids=ids, attention_mask=mask)[mask.bool()]
    g_pad = torch.autograd.grad((padded * weights).sum(), params)
    assert not calls
    packed_ids = ids[mask.bool()][None]
    pos = torch.cat([torch.arange(m) for m in lens])[None]
    # use_cache=False: transformers hands the mask function its packed-sequence mask (when it
    # detects packing: newer versions); Llama's default (a cache object): packing is read
    # from position_ids in the attention (flash-attention-2's rule)
    from transformers import masking_utils as mu

    variants = [dict()] if kind == "llama" else []
    if hasattr(mu, "find_packed_sequence_indices"):
        variants.append(dict(use_cache=False))
    if not variants:
        pytest.skip("this transformers detects no packed sequences for this model")
    for kw in variants:
        calls.clear()
        packed = run(input_ids=packed_ids, position_ids=pos, **kw)[0]
        assert calls, f"the packed (varlen) path was not taken ({kw})"
        g_packed = torch.autograd.grad((packed * weights).sum(), params)
        torch.testing.assert_close(packed, padded, atol=2e-5, rtol=1e-4)
        for a, b in zip(g_packed, g_pad):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    # flash-attention's keyword arguments alone select the same path
    if kind == "llama":
        cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
        again = run(input_ids=packed_ids, position_ids=pos, **kw)[0]
        torch.testing.assert_close(again, packed)


def _count_packed(forward, calls):
    def wrapped(self, *a, cu_seqlens=None, **k):
        if cu_seqlens is not None:
            calls.append(1)
        return forward(self, *a, cu_seqlens=cu_seqlens, **k)
    return wrapped


def test_packed_positions_checked_once_per_forward():
    pos = torch.cat([torch.arange(3), torch.arange(4)])[None]
    a = hf_attention._packed_from_positions(pos, 1, 7)
    assert a is not None and hf_attention._packed_from_positions(pos, 1, 7) is a
    assert a.cu_seqlens()[0].tolist() == [0, 3, 7]
    assert hf_attention._packed_from_positions(torch.arange(7)[None], 1, 7) is None
    assert hf_attention._packed_from_positions(pos, 2, 7) is None       # more than one row


def test_packed_kwargs_converted_once_per_forward():
    """flash-attention's cu_seq_lens kwargs: checked and converted once for all layers; keys
    packed differently from the queries are refused."""
    cu = torch.tensor([0, 3, 7])                                   # int64, as a collator may give
    a = hf_attention._packed_from_kwargs(cu, cu, 4)
    assert a[0].dtype == torch.int32 and a[0].tolist() == [0, 3, 7] and a[1] == 4
    assert hf_attention._packed_from_kwargs(cu, cu, 4)[0] is a[0]
    with pytest.raises(ValueError, match="cu_seq_lens_k != cu_seq_lens_q"):
        hf_attention._packed_from_kwargs(torch.tensor([0, 3, 7]), torch.tensor([0, 2, 7]), 4)


def test_packed_kwargs_max_length_is_each_calls_own():
    """The remembered conversion is keyed on the lengths tensors; max_length_q is not one of
    them and is each call's own (a call with a corrected max_length_q got the first call's
    value back: after a too-small one, every retry failed; after a right one, a too-small one
    passed)."""
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    assert hf_attention._packed_from_kwargs(cu, cu, 2)[1] == 2
    assert hf_attention._packed_from_kwargs(cu, cu, 4)[1] == 4
    assert hf_attention._packed_from_kwargs(cu, cu, None)[1] is None
    q = torch.randn(1, 2, 6, 16)
    m = torch.nn.Module()
    m.is_causal, m.kfused_backend = True, "reference"

    def call(max_q):
        return hf_attention.kfused_inducer_attention_forward(
            m, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_q,
            max_length_k=max_q)

    with pytest.raises(ValueError, match="shorter than the longest sequence"):
        call(2)
    call(4)
    call(None)
    with pytest.raises(ValueError, match="shorter than the longest sequence"):
        call(2)


def test_packed_kwargs_under_inference_mode():
    """Inference tensors (no version counter) bypass the cache, and later ordinary calls
    still work (they failed with "'NoneType' object is not iterable")."""
    with torch.inference_mode():
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        a = hf_attention._packed_from_kwargs(cu, None, 7)
        pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
        b = hf_attention._packed_from_positions(pos, 1, 12)
    assert a[0].tolist() == [0, 5, 12] and b.cu_seqlens()[0].tolist() == [0, 5, 12]
    c = hf_attention._packed_from_kwargs(torch.tensor([0, 3, 7]), None, 4)
    assert c[0].tolist() == [0, 3, 7]
    pos = torch.cat([torch.arange(3), torch.arange(4)])[None]
    assert hf_attention._packed_from_positions(pos, 1, 7).cu_seqlens()[0].tolist() == [0, 3, 7]


def test_module_names_q_heads_and_width_against_its_configuration():
    """q with the wrong head count or width is named as such, not as a parameter's shape
    (``Ak has shape (2, 32, 3), expected (4, 32, 3)``)."""
    ad = InducerAttention(2, 32, key_bottleneck=3, value_bottleneck=5)
    for shape, match in (((1, 4, 5, 32), r"q has 4 heads \(shape \(1, 4, 5, 32\).*num_heads=2"),
                         ((1, 2, 5, 64), r"q has head width 64 .*head_dim=32")):
        q = torch.randn(*shape)
        with pytest.raises(ValueError, match=match):
            ad(q, q, q, backend="reference")
    q = torch.randn(6, 3, 32)                                  # packed (total, H, p)
    with pytest.raises(ValueError, match=r"q has 3 heads .*\(total, heads, head_dim\).*"
                                         r"num_heads=2"):
        ad(q, q, q, cu_seqlens=torch.tensor([0, 6]), backend="reference")
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        ad(torch.randn(2, 5, 32), torch.randn(2, 5, 32), torch.randn(2, 5, 32))
    pre = InducerAttention(2, 32, prefix_len=2, inducer=False)
    with pytest.raises(ValueError, match="q has 4 heads"):
        pre(*(torch.randn(1, 4, 5, 32) for _ in range(3)), backend="reference")
    q, kv = torch.randn(1, 2, 5, 32), torch.randn(1, 1, 5, 32)  # fewer kv heads: fine
    assert ad(q, kv, kv, backend="reference")[0].shape == q.shape


def test_module_output_projection_checks_u_and_weight():
    """The module's output projection takes the functional op's checks: a wrong r or n of u,
    or a u given to an adapter without an output-space value path, is a ValueError naming u
    (it was a raw matmul / cat RuntimeError)."""
    H, p, d, r = 2, 32, 48, 4
    m = InducerAttention(H, p, d_model=d, composition="add", value_bottleneck=r)
    f, u = torch.randn(2, H, 5, p), torch.randn(2, H, 5, r)
    W_o, b_o = torch.randn(d, H * p), torch.randn(d)
    y = m.output_projection(f, u, W_o, b_o)
    want = inducer_output_projection(f, u, W_o, b_o, m.W2, m.b2)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(m.output_projection(f, u, W_o.t(), b_o, layout="conv1d"), want)
    with pytest.raises(ValueError, match=r"u has shape \(2, 2, 5, 2\), expected \(2, 2, 5, 4\)"):
        m.output_projection(f, u[..., :2], W_o, b_o)
    with pytest.raises(ValueError, match=r"u has shape \(2, 2, 3, 4\), expected \(2, 2, 5, 4\)"):
        m.output_projection(f, u[:, :, :3], W_o, b_o)
    with pytest.raises(ValueError, match=r"f has 4 heads .*num_heads=2"):
        m.output_projection(torch.randn(2, 4, 5, p), u, W_o, b_o)
    with pytest.raises(ValueError, match=r"weight has shape \(48, 10\).*\(d, 64\)"):
        m.output_projection(f, u, W_o[:, :10], b_o)
    with pytest.raises(ValueError, match="d_model=48"):
        m.output_projection(f, u, torch.randn(20, H * p), None)
    with pytest.raises(ValueError, match="layout must be one of"):
        m.output_projection(f, u, W_o, b_o, layout="conv")
    with pytest.raises(ValueError, match="weight is on meta but f is on cpu"):
        m.output_projection(f, u, W_o.to("meta"), b_o)
    with pytest.raises(ValueError, match=r"b_o has shape \(1,\)"):
        m.output_projection(f, u, W_o, b_o[:1])
    torch.testing.assert_close(m.output_projection(f, u, W_o.double(), b_o.double()), want)
    with pytest.raises(ValueError, match=r"bias has shape \(1,\)"):
        m.fused_output_weight(W_o, b_o[:1])
    for kw in (dict(composition="gate"), dict(inducer=False, prefix_len=2)):
        g = InducerAttention(H, p, d_model=d, **kw)
        with pytest.raises(ValueError, match="u was given .* pass u=None"):
            g.output_projection(f, u, W_o, b_o)
        torch.testing.assert_close(g.output_projection(f, None, W_o, b_o),
                                   inducer_output_projection(f, None, W_o, b_o))


def test_output_projection_wrapper_checks_its_input():
    H, p, d, r = 2, 32, 48, 4
    m = InducerAttention(H, p, d_model=d, value_bottleneck=r)
    lin = torch.nn.Linear(H * p, d)
    wrap = InducerOutputProjection(lin, m)
    x = torch.randn(2, 5, H * (p + r))
    f = x.reshape(2, 5, H, p + r)[..., :p].reshape(2, 5, H * p)
    u = x.reshape(2, 5, H, p + r)[..., p:].permute(0, 2, 1, 3)
    want = lin(f) + u.transpose(1, 2).reshape(2, 5, H * r) @ m.W2.reshape(H * r, d) + m.b2
    torch.testing.assert_close(wrap(x), want)
    torch.testing.assert_close(wrap(f), lin(f))
    with pytest.raises(ValueError, match=r"x has shape \(2, 5, 7\): width 7, expected H·p = 64 "
                                         r".* or H·\(p \+ r\) = 72"):
        wrap(torch.randn(2, 5, 7))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        wrap(x.tolist())
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        wrap(torch.tensor(1.0))
    with pytest.raises(ValueError, match="x is on meta but the projection's weight is on cpu"):
        wrap(x.to("meta"))
    gate = InducerOutputProjection(lin, InducerAttention(H, p, d_model=d, composition="gate"))
    with pytest.raises(ValueError, match=r"expected H·p = 64 .*adds no u columns"):
        gate(x)


@pytest.mark.parametrize("kind", ["lora", "krona", "headwise"])
@pytest.mark.parametrize("d", [8, 10])
def test_output_projection_wrapper_over_an_adapted_projection(kind, d):
    # Probe: a base that is not a bare nn.Linear (an adapter on the output projection) was
    # read as a Conv1D weight: square (d = H·p) it was applied transposed and without its
    # update, silently; otherwise refused with a Conv1D shape error. It now runs the base's
    # forward on f and W2 on u beside it.
    from torch.func import functional_call

    from kfused.modules import HeadwiseOutput, KronALinear, LoRALinear, ProjRanks
    from kfused.testing import assert_against_reference

    H, p, r, T = 2, 4, 3, 6
    lin = torch.nn.Linear(H * p, d)
    base = (LoRALinear(lin, r=2, init="random") if kind == "lora" else
            KronALinear(lin, a_shape=(2, 2), init="random", backend="reference")
            if kind == "krona" else
            HeadwiseOutput(lin, H, ProjRanks(wise=2, shared=1), init="random"))
    ad = InducerAttention(H, p, d_model=d, value_bottleneck=r)
    wrap = InducerOutputProjection(base, ad)
    names = [n for n, _ in wrap.named_parameters()]
    keys = {n: "p_" + n.replace(".", "_") for n in names}
    inputs = {"x": torch.randn(T, H * (p + r), dtype=torch.float64)}
    inputs.update({keys[n]: t.detach().double() for n, t in wrap.named_parameters()})
    trained = ["x"] + [keys[n] for n, t in wrap.named_parameters() if t.requires_grad]

    def kernel(x, **ps):
        return functional_call(wrap, {n: ps[keys[n]] for n in names}, (x,))

    def ref(x, **ps):
        rows = x.reshape(T, H, p + r)
        f, u = rows[..., :p].reshape(T, H * p), rows[..., p:]
        params = {n: ps[keys[n]] for n in names if n.startswith("base.")}
        y = functional_call(wrap, params, (f,))     # the plain width runs the base alone
        return (y + torch.einsum("thr,hrd->td", u, ps[keys["adapter.W2"]])
                + ps[keys["adapter.b2"]])

    assert_against_reference(kernel, ref, inputs, torch.float32, grad_names=trained)
    with torch.no_grad():
        want = ref(**{k: v.float() for k, v in inputs.items()})
    base.merge()
    torch.testing.assert_close(wrap(inputs["x"].float()), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,value", [("softcap", 50.0), ("s_aux", torch.zeros(2))])
def test_attention_refuses_score_changes_it_cannot_apply(name, value):
    """Gemma-2 passes its logit soft-capping and gpt-oss its attention sinks to the attention
    function: the kernel applies neither, so both are refused (they were silently dropped)."""
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = hf_attention.kfused_inducer_attention_forward(module, q, q, q, None)
    assert out.shape == (1, 3, 2, 8)
    with pytest.raises(NotImplementedError, match=name):
        hf_attention.kfused_inducer_attention_forward(module, q, q, q, None, **{name: value})


@pytest.mark.parametrize("method", ["inducer", "prefix"])
def test_hf_generate_with_a_static_cache_matches_the_dynamic_cache(method):
    """A static cache has more slots than filled ones; the kernel aligns causality to the last
    key, so the attention must read the filled window only (the empty slots were attended to,
    silently, without padding; with padding the mask's width was refused)."""
    from kfused.integration import AdapterConfig, inject

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny("llama").config).eval()
    inject(model, AdapterConfig(method=method, r=2, init="paper", backend="reference"))
    ids = torch.randint(3, 50, (2, 6))
    for mask in (torch.ones(2, 6, dtype=torch.long), torch.tensor([[0, 0, 1, 1, 1, 1]] * 2)):
        mask[1] = 1
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                  pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            want = model.generate(**kw)
            got = model.generate(cache_implementation="static", **kw)
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_output_projections_run_in_the_autocast_dtype():
    # Under autocast the fused [f | u] GEMM (wrapper) and output_projection (an op opaque to
    # autocast) computed in float32 for a float32 input while the plain-width path and the
    # base linear gave the autocast dtype; the output dtype depended on the input's width.
    from torch import nn

    H, p, r = 2, 4, 3
    a = InducerAttention(H, p, value_bottleneck=r).to(DEVICE)
    base = nn.Linear(H * p, H * p).to(DEVICE)
    wrap = InducerOutputProjection(base, a)
    f, u = torch.randn(2, H, 3, p, device=DEVICE), torch.randn(2, H, 3, r, device=DEVICE)
    x = torch.cat([f, u], -1).transpose(1, 2).reshape(2, 3, H * (p + r))
    want_x, want_f = wrap(x), a.output_projection(f, u, base.weight, base.bias)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert base(x[..., :H * p]).dtype == torch.bfloat16
        y_x = wrap(x)
        y_f = a.output_projection(f, u, base.weight, base.bias)
        y_mixed = a.output_projection(f.bfloat16(), u, base.weight, base.bias)
    for y, want in ((y_x, want_x), (y_f, want_f), (y_mixed, want_f)):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), want, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("method", ["inducer", "prefix"])
def test_hf_llama_attention_runs_under_autocast(method):
    """Under autocast a Llama-style model's rotary embedding hands the attention a float32 q
    and k (its float32 cos/sin) beside a float16 v; SDPA and eager run it in the autocast
    dtype, and kfused_inducer refused the mixed dtypes (TypeError) at every forward, so an
    inducer / prefix model could neither train nor generate under autocast."""
    import copy

    from kfused.integration import AdapterConfig, inject

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_tiny("llama").config).eval()
    model = copy.deepcopy(base)
    init = "zero" if method == "inducer" else None
    inject(model, AdapterConfig(method=method, r=2, init=init, backend="reference"))
    ids = torch.randint(3, 50, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        got = model(input_ids=ids, attention_mask=mask).logits
        want = base(input_ids=ids, attention_mask=mask).logits
        cached = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                do_sample=False, pad_token_id=0)
        uncached = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                  do_sample=False, pad_token_id=0, use_cache=False)
    assert got.dtype == want.dtype == torch.float16
    assert torch.equal(cached, uncached)
    if method == "inducer":                       # an exact start: the frozen model's logits
        keep = mask.bool()
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-3, atol=1e-3)


def test_transformers_4_mask_interface_is_refused_by_name(monkeypatch):
    """transformers 4.x hands the mask interface cache_position instead of q_length, so the
    kfused_inducer mask function failed inside transformers with a bare TypeError (and, with
    the signature patched, GPT-2 gave wrong outputs): inducer and prefix attention are refused
    at inject with the reason, and the model is left as it was."""
    from transformers import masking_utils as mu

    from kfused.integration import AdapterConfig, inject

    def sdpa_mask_4x(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None,
                     attention_mask=None, **kwargs):
        raise AssertionError("not called")

    model = _tiny("gpt2").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(mu, "sdpa_mask", sdpa_mask_4x)
    with pytest.raises(ValueError, match=r"attention-mask interface \(no q_length\).*>= 5"):
        hf_attention.add_inducers(model, key_bottleneck=2, value_bottleneck=2, init="zero")
    for method in ("inducer", "prefix"):
        with pytest.raises(ValueError, match="no q_length"):
            inject(model, AdapterConfig(method=method, r=2, backend="reference"))
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not any(isinstance(m, InducerOutputProjection) for m in model.modules())
    monkeypatch.undo()
    assert hf_attention.unsupported_reason(model) is None


@pytest.mark.parametrize("kind", ["gpt2", "roberta", "llama"])
def test_functional_call_leaves_the_adapters_parameters_in_place(kind):
    # the "add" adapter was a submodule under two names (the attention layer's kfused_inducer
    # and the output projection's adapter): torch.func.functional_call (and so torch.func.grad
    # over a model) then left its own tensors in place of the parameters (pytorch#164759):
    # the optimizer's parameters were no longer the model's, the adapters stopped training
    torch.manual_seed(0)
    model = _tiny(kind)
    adapters = hf_attention.add_inducers(model, key_bottleneck=2, value_bottleneck=3)
    ids, mask = _inputs(kind)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def loss(p):
        out = torch.func.functional_call(model, p, (ids,), {"attention_mask": mask})
        return out.last_hidden_state[mask.bool()].pow(2).mean()

    grads = torch.func.grad(loss)({n: p.detach() for n, p in params.items()})
    assert all(model.get_parameter(n) is p for n, p in params.items())
    loss(params).backward()
    for n, p in params.items():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)
    assert all(a.W2.grad is not None and a.W2.grad.abs().sum() > 0 for a in adapters)
    names = {n for n, _ in model.named_modules(remove_duplicate=False)
             if any(n.endswith(s) for s in (".adapter", ".kfused_inducer"))}
    assert len(names) == len(adapters)            # one name per adapter


def test_state_dict_of_the_two_name_layout_still_loads():
    # a Trainer checkpoint written before held the "add" adapter as <attn>.kfused_inducer.*
    torch.manual_seed(0)
    src = _tiny("llama")
    hf_attention.add_inducers(src, key_bottleneck=2, value_bottleneck=3)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    sd = src.state_dict()
    assert not any(".kfused_inducer." in k for k in sd)
    old = {k.replace("self_attn.o_proj.adapter.", "self_attn.kfused_inducer."): v
           for k, v in sd.items()}
    assert old.keys() != sd.keys()
    dst = _tiny("llama")
    hf_attention.add_inducers(dst, key_bottleneck=2, value_bottleneck=3)
    dst.load_state_dict(old)                          # strict: every key placed
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in sd.items())


def test_sliding_window_layers_run_while_the_window_hides_no_key():
    # Mistral-style sliding-window layers were always refused: the window mask function was
    # not recognised, although with at most `window` keys up to the last query (a short
    # sequence, or a sliding cache that keeps window - 1 keys) the window hides none of them
    import copy

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=64, num_attention_heads=2,
                                     num_key_value_heads=1, num_hidden_layers=2,
                                     intermediate_size=96, vocab_size=50,
                                     max_position_embeddings=64, sliding_window=8)
    base = transformers.MistralForCausalLM(cfg).eval()
    base.set_attn_implementation("sdpa")
    model = copy.deepcopy(base)
    from kfused.integration import AdapterConfig, inject

    inject(model, AdapterConfig(method="inducer", r=2, init="zero", backend="reference"))
    for n in (5, 8):                                  # left padding, window not reached
        ids, mask = torch.randint(3, 50, (2, n)), torch.ones(2, n, dtype=torch.long)
        mask[1, :2] = 0
        keep = mask.bool()
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[keep],
                                   base(input_ids=ids, attention_mask=mask).logits[keep],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="sliding window of 8 keys would hide some "
                                                  "of the 9 keys"):
        model(input_ids=torch.randint(3, 50, (1, 9)))
    # generation past the window: the sliding cache keeps the window's keys only
    ids = torch.randint(3, 50, (1, 5))
    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    got, want = model.generate(ids, **kw), base.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
