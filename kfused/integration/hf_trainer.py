"""transformers Trainer support: save the adapters (kfused format) with every Trainer checkpoint.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[AdapterCheckpointCallback()])

Each ``checkpoint-<step>/`` then also holds ``kfused_adapter/`` (see
:mod:`kfused.integration.checkpoint`), loadable with ``kfused.integration.load``. The Trainer
itself needs nothing else: the injected model is an ordinary module whose only trainable
parameters are the adapters.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from kfused.integration.checkpoint import save

SUBDIR = "kfused_adapter"


class AdapterCheckpointCallback(TrainerCallback):
    """On every Trainer save, write the adapters to
    ``<output_dir>/checkpoint-<step>/kfused_adapter``."""

    def on_save(self, args, state, control, model=None, **kwargs):
        if model is not None:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", SUBDIR)
            save(model, path)
        return control
