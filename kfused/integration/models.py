"""Tiny transformers models built offline from configs (random weights): tests, demo, benchmarks."""

from __future__ import annotations

from typing import Optional

from torch import nn

ARCH_NAMES = ("gpt2", "llama", "roberta", "t5")


def tiny_model(arch: str, *, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
               vocab: int = 128, max_len: int = 128, d_ff: Optional[int] = None,
               attn_implementation: str = "eager", d_kv: Optional[int] = None) -> nn.Module:
    """A small randomly initialised LM of the given family ("gpt2", "llama", "roberta", "t5").

    GPT-2 and Llama are causal LMs, RoBERTa a masked LM, T5 a seq2seq LM. ``attn_implementation``
    defaults to "eager" so the model is identical on every torch version. ``d_kv`` (T5 only) is
    the head width, default ``d_model // n_heads``; T5 allows ``n_heads · d_kv != d_model``.
    """
    import transformers as tf

    d_ff = d_ff or 4 * d_model
    kw = dict(attn_implementation=attn_implementation)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=n_heads, vocab_size=vocab,
                            n_positions=max_len, n_inner=d_ff, bos_token_id=0, eos_token_id=0,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel._from_config(cfg, **kw)
    if arch == "llama":
        cfg = tf.LlamaConfig(hidden_size=d_model, intermediate_size=d_ff,
                             num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=max(1, n_heads // 2),
                             vocab_size=vocab, max_position_embeddings=max_len, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0)
        return tf.LlamaForCausalLM._from_config(cfg, **kw)
    if arch in ("roberta", "bert"):
        cfg = tf.RobertaConfig(hidden_size=d_model, num_hidden_layers=n_layers,
                               num_attention_heads=n_heads, intermediate_size=d_ff,
                               vocab_size=vocab, max_position_embeddings=max_len + 2,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               pad_token_id=1, bos_token_id=0, eos_token_id=2)
        return tf.RobertaForMaskedLM._from_config(cfg, **kw)
    if arch == "t5":
        cfg = tf.T5Config(d_model=d_model, d_ff=d_ff, num_layers=n_layers, num_heads=n_heads,
                          d_kv=d_kv or d_model // n_heads, vocab_size=vocab, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return tf.T5ForConditionalGeneration._from_config(cfg, **kw)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCH_NAMES}")
