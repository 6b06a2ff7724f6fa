"""Pretrain the small GPT-2-shaped base model that ships in ``kfused/data/base/``.

No model hub can be reached, so ``kfused demo`` adapts a base that this script pretrains on
the generated English of :mod:`kfused.data.make_corpus` (descriptive prose about places plus
"record, separator, description" notes; none of the demo task's data). Byte-level like the
demo: :class:`kfused.data.ByteTokenizer` (bytes 0-255 plus PAD/BOS/SEP/EOS, vocab 260).

Reproducible: a fixed seed, a fixed corpus, a fixed number of steps, float32 on the CPU
(bit-identical weights need the same torch version and thread count). The weights are stored
in float16 (the demo loads them as float32 and keeps the base frozen) with ``config.json``
and ``pretrain.json`` (steps, tokens, time, load, final training and held-out loss of the
float16 weights, how often its greedy descriptions of held-out notes state the record's name,
versions, sha256 of the weights) beside them:

    python -m kfused.data.pretrain_base                 # the shipped run: ~25 min on 2 threads (pretrain.json)
    python -m kfused.data.pretrain_base --steps 20 --out /tmp/base   # a quick try
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import tempfile
import time
from typing import List, Optional

import torch

from kfused._files import folder_refusal, sha256_file
from kfused.data import ByteTokenizer
from kfused.data.make_corpus import documents, record_name

BASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base")

WHAT = ("GPT-2-shaped byte-level LM pretrained by kfused.data.pretrain_base on the generated "
        "English of kfused.data.make_corpus (none of the demo task's data)")

# The shipped base's shape (GPT-2 layout, learned positions, tied embeddings).
SHAPE = dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, max_len=384)


def build_parser() -> argparse.ArgumentParser:
    from kfused.cli.args import (DefaultsHelpFormatter, int_range, positive_float, positive_int,
                                 seed_int)

    p = argparse.ArgumentParser(prog="python -m kfused.data.pretrain_base",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=6000, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int_range(2, SHAPE["max_len"]), default=SHAPE["max_len"],
                   help=f"tokens per packed sequence (2 to the model's {SHAPE['max_len']} "
                        "positions)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=positive_int, default=60, help="linear warm-up steps")
    p.add_argument("--docs", type=positive_int, default=48000,
                   help="corpus documents to generate")
    p.add_argument("--seed", type=seed_int, default=0, help="initialisation and batch-order seed")
    p.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads")
    p.add_argument("--out", default=BASE_DIR, help="output directory")
    return p


def encode_documents(docs, tok: ByteTokenizer) -> torch.Tensor:
    """One token stream: BOS [record SEP] text EOS, document after document."""
    ids: List[int] = []
    for record, text in docs:
        ids.append(tok.BOS)
        if record:
            ids += tok.encode(record) + [tok.SEP]
        ids += tok.encode(text) + [tok.EOS]
    return torch.tensor(ids, dtype=torch.long)


def build_model(seed: int = 0):
    from kfused.integration.models import tiny_model

    torch.manual_seed(seed)
    model = tiny_model("gpt2", d_model=SHAPE["d_model"], n_layers=SHAPE["n_layers"],
                       n_heads=SHAPE["n_heads"], d_ff=SHAPE["d_ff"],
                       vocab=ByteTokenizer.vocab_size, max_len=SHAPE["max_len"])
    tok = ByteTokenizer()  # the special tokens, for generate()
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.BOS, tok.EOS, tok.PAD
    return model


@torch.no_grad()
def mean_loss(model, chunks: torch.Tensor, batch: int = 16) -> float:
    model.eval()
    tot = 0.0
    for i in range(0, chunks.shape[0], batch):
        x = chunks[i:i + batch]
        tot += float(model(input_ids=x, labels=x).loss) * x.shape[0]
    return tot / chunks.shape[0]


@torch.no_grad()
def name_copy_rate(model, docs, max_new: int = 48) -> float:
    """The fraction of ``docs``' notes whose greedy description (from ``BOS record SEP``)
    states the record's venue name: whether the base copies a name it cannot have memorised
    (most are coined per document) from its context, as a data-to-text task needs."""
    tok = ByteTokenizer()
    model.eval()
    notes = [(record, record_name(record)) for record, _ in docs if record]
    hits = 0
    for record, name in notes:
        ids = torch.tensor([[tok.BOS] + tok.encode(record) + [tok.SEP]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=tok.EOS,
                             pad_token_id=tok.PAD)
        hits += name in tok.decode(out[0, ids.shape[1]:].tolist())
    return hits / max(1, len(notes))


OUTPUTS = ("config.json", "generation_config.json", "model.safetensors", "pretrain.json")


def _out_refusal(out: str) -> Optional[str]:
    """Why ``out`` cannot take the base's files (None if it can): kfused never overwrites a
    model it did not write (one without this script's pretrain.json beside it)."""
    unusable = folder_refusal(out)  # a file, under one, not writable: found after training
    if unusable:
        return f"--out {unusable}"
    taken = [n for n in OUTPUTS if os.path.lexists(os.path.join(out, n))]
    if not taken:
        return None
    try:
        with open(os.path.join(out, "pretrain.json")) as f:
            record = json.load(f)
        ours = str(record.get("what", "")).startswith(WHAT.split(" (")[0])
    except (OSError, ValueError, AttributeError):
        record, ours = {}, False
    if not ours:
        return (f"--out {out} holds {', '.join(taken)} that kfused.data.pretrain_base did not "
                "write (no pretrain.json of its own); not overwriting them")
    if os.path.lexists(os.path.join(out, "model.safetensors")) and \
            not _names_weights(out, record):
        # its own record beside weights it does not name (a user's fine-tuned weights put
        # there, or a link): those are not this script's to replace
        return (f"--out {out}: model.safetensors is not the weights its pretrain.json "
                "records (weights_sha256 differs); not overwriting it")
    return None


def _names_weights(out: str, record) -> bool:
    """Whether ``out``'s model.safetensors is a regular file (not a link) whose SHA-256 is
    the one ``record`` (a loaded pretrain.json) gives."""
    weights = os.path.join(out, "model.safetensors")
    try:
        return (not os.path.islink(weights) and isinstance(record, dict)
                and sha256_file(weights) == record.get("weights_sha256"))
    except OSError:
        return False


STAGING = ".pretrain-staging-"
PREVIOUS = "previous"


def _swap_in(stage: str, out: str) -> None:
    """Move the new version's files from ``stage`` into ``out``. The earlier files go first
    into ``stage/previous/`` (the record first: an old record never stands beside new
    weights), then the new ones in (the record last); a failure or interrupt part way moves
    the earlier files back. Before, the four files were moved in one by one over the earlier
    ones: interrupted, new weights stood beside the earlier record (its hash not theirs)."""
    prev = os.path.join(stage, PREVIOUS)
    os.mkdir(prev)
    old, new = [], []
    try:
        for name in reversed(OUTPUTS):
            if os.path.lexists(os.path.join(out, name)):
                os.replace(os.path.join(out, name), os.path.join(prev, name))
                old.append(name)
        for name in OUTPUTS:
            os.replace(os.path.join(stage, name), os.path.join(out, name))
            new.append(name)
    except BaseException:
        _restore(prev, out, new)
        raise


def _restore(prev: str, out: str, new) -> None:
    """Undo a partial :func:`_swap_in`: remove the new files it moved in (``new``), move the
    earlier ones in ``prev`` back."""
    for name in new:
        try:
            os.unlink(os.path.join(out, name))
        except OSError:
            pass
    for name in os.listdir(prev):
        if name in OUTPUTS:
            os.replace(os.path.join(prev, name), os.path.join(out, name))


def _recover(out: str) -> None:
    """A run killed during :func:`_swap_in` (no exception handler ran) left the earlier
    version's files in ``out/.pretrain-staging-*/previous/``: when ``out`` does not hold a
    whole version (a file missing, or weights its record does not name), put them back."""
    try:
        stages = [n for n in os.listdir(out) if n.startswith(STAGING)]
    except OSError:
        return
    for n in stages:
        prev = os.path.join(out, n, PREVIOUS)
        if not os.path.isdir(prev) or not os.listdir(prev):
            continue
        whole = all(os.path.isfile(os.path.join(out, f)) for f in OUTPUTS)
        if whole:
            try:
                with open(os.path.join(out, "pretrain.json")) as f:
                    whole = _names_weights(out, json.load(f))
            except (OSError, ValueError):
                whole = False
        if not whole:
            _restore(prev, out, [])
            print(f"pretrain_base: put back the earlier version a killed run had moved "
                  f"aside ({prev})")
        shutil.rmtree(os.path.join(out, n), ignore_errors=True)


class Refusal(ValueError):
    """An argument this run cannot take, found before anything runs or is written (``main``
    reports it as a usage error, not a traceback)."""


def pretrain(args) -> dict:
    _recover(args.out)
    refusal = _out_refusal(args.out)
    if refusal:  # before the corpus and the training: nothing is written
        raise Refusal(refusal)
    torch.set_num_threads(args.threads)
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    stream = encode_documents(documents(args.docs, seed=1234), tok)
    held = encode_documents(documents(400, seed=4321), tok)  # a separate held-out corpus
    T = args.seq_len
    chunks = stream[: (stream.numel() // T) * T].view(-1, T)
    held = held[: (held.numel() // T) * T].view(-1, T)
    if chunks.shape[0] == 0:  # before anything is written
        raise Refusal(f"--docs {args.docs} gives {stream.numel()} tokens, fewer than one "
                      f"--seq-len {T} sequence")
    model = build_model(args.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    epochs = math.ceil(args.steps * args.batch_size / chunks.shape[0]) + 1
    order = torch.cat([torch.randperm(chunks.shape[0], generator=g) for _ in range(epochs)])
    losses = []
    t_train = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = chunks[order[step * args.batch_size:(step + 1) * args.batch_size]]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t_train
            print(f"step {step:5d}  loss {losses[-1]:.4f}  lr {lr:.2e}  {el:7.1f} s", flush=True)
    train_s = time.perf_counter() - t_train
    model.half().float()  # evaluate exactly what is stored (float16)
    held_loss = mean_loss(model, held)
    copy_rate = name_copy_rate(model, documents(120, seed=4321))
    os.makedirs(args.out, exist_ok=True)
    # every file is written into a staging folder inside --out first, then moved into place
    # with the record last: a failure or kill while writing leaves the earlier version whole
    stage = tempfile.mkdtemp(dir=args.out, prefix=STAGING)
    try:
        _write_version(model, stage, losses, held_loss, copy_rate, stream, train_s, t0,
                       tok, args)
        _swap_in(stage, args.out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    with open(os.path.join(args.out, "pretrain.json")) as f:
        info = json.load(f)
    print(f"held-out loss {held_loss:.4f} nats/byte; names copied into {100 * copy_rate:.0f}% "
          f"of held-out notes' descriptions; trained {train_s:.0f} s; wrote {args.out}")
    return info


def _write_version(model, out, losses, held_loss, copy_rate, stream, train_s, t0, tok,
                   args) -> None:
    """The base's four files (OUTPUTS) into ``out``."""
    T = args.seq_len
    model.half().save_pretrained(out, safe_serialization=True)
    path = os.path.join(out, "model.safetensors")
    sha = sha256_file(path)
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    import transformers

    info = {
        "what": WHAT,
        "shape": SHAPE, "vocab": tok.vocab_size,
        "params": sum(p.numel() for p in model.parameters()),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "corpus_tokens": int(stream.numel()), "train_tokens": args.steps * args.batch_size * T,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "final_train_loss_nats_per_byte": round(sum(losses[-20:]) / min(20, len(losses)), 4),
        "first_train_loss": round(losses[0], 4),
        "heldout_loss_nats_per_byte_float16_weights": round(held_loss, 4),
        "heldout_note_name_copy_rate": round(copy_rate, 3),
        "loss_every_50_steps": [round(x, 4) for x in losses[::50]],
        "load_average_at_end": load, "cpu_threads": args.threads,
        "machine": platform.machine(), "torch": torch.__version__,
        "transformers": transformers.__version__, "weights_dtype": "float16",
        "weights_sha256": sha,
    }
    missing = [n for n in OUTPUTS[:-1] if not os.path.exists(os.path.join(out, n))]
    if missing:  # transformers changed what save_pretrained writes
        raise RuntimeError(f"save_pretrained did not write {missing} (kfused moves {OUTPUTS})")
    with open(os.path.join(out, "pretrain.json"), "w") as f:
        json.dump(info, f, indent=2)


def main(argv=None) -> None:  # pragma: no cover
    parser = build_parser()
    args = parser.parse_args(argv)
    _recover(args.out)
    refusal = _out_refusal(args.out)
    if refusal:
        parser.error(f"argument {refusal}")
    try:
        pretrain(args)
    except Refusal as exc:  # e.g. --docs too few for one --seq-len sequence
        parser.error(f"argument {exc}")


if __name__ == "__main__":  # pragma: no cover
    main()
