"""transformers Trainer support: save the adapters (kfused format) with every Trainer checkpoint.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[AdapterCheckpointCallback()])

Each ``checkpoint-<step>/`` (a trial's own during a hyperparameter search) then also holds
``kfused_adapter/`` (see :mod:`kfused.integration.checkpoint`), loadable with
``kfused.integration.load``. The Trainer itself needs nothing else: the injected model is an
ordinary module whose only trainable parameters are the adapters.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from kfused.integration.checkpoint import save

SUBDIR = "kfused_adapter"


def checkpoint_dir(args, state) -> str:
    """The folder the Trainer just wrote this step's checkpoint to: ``<output_dir>/
    checkpoint-<step>``, or during a hyperparameter search (``state.trial_params`` set) its
    trial's ``<output_dir>/<run>/checkpoint-<step>`` (the Trainer's ``_get_output_dir(trial)``,
    whose run name a callback is not told: the newest such folder, the one just written).
    Before, every trial's adapters went to ``<output_dir>/checkpoint-<step>``, each trial's
    save replacing the last trial's and none beside the checkpoint it belongs to."""
    name = f"checkpoint-{state.global_step}"
    plain = os.path.join(args.output_dir, name)
    if getattr(state, "trial_params", None) is None:
        return plain
    try:
        runs = [os.path.join(args.output_dir, d, name) for d in os.listdir(args.output_dir)]
    except OSError:
        return plain
    found = [p for p in runs + [plain] if os.path.isdir(p)]
    return max(found, key=os.path.getmtime) if found else plain


class AdapterCheckpointCallback(TrainerCallback):
    """On every Trainer save, write the adapters to ``kfused_adapter/`` inside the checkpoint
    folder the Trainer wrote (:func:`checkpoint_dir`)."""

    def on_save(self, args, state, control, model=None, **kwargs):
        if model is not None:
            save(model, os.path.join(checkpoint_dir(args, state), SUBDIR))
        return control
