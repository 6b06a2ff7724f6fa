"""Shared helpers for the integration tests: tiny models, batches, a few training steps."""

import torch

from kfused.integration.models import tiny_model

ARCHS = ["gpt2", "llama", "roberta", "t5"]
VOCAB = 128


def make(arch, seed=0, **kw):
    torch.manual_seed(seed)
    return tiny_model(arch, vocab=VOCAB, **kw)


def batch(arch, b=2, n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, n), generator=g)
    if arch == "t5":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (b, n // 2), generator=g)}
    return {"input_ids": ids, "labels": ids.clone()}


def logits(model, arch, inputs):
    return model(**inputs).logits


def embeds_forward(model, arch, emb):
    """Forward from input embeddings (a float input the docs/math.md §4 harness can cast)."""
    if arch == "t5":
        return model(inputs_embeds=emb, decoder_inputs_embeds=emb).logits
    return model(inputs_embeds=emb).logits


def train_steps(model, arch, steps=6, lr=1e-2, inputs=None):
    inputs = inputs or batch(arch)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
