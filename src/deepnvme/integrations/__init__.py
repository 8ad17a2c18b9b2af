"""Plugins for other frameworks. Each integration module imports its framework and is imported
only by that framework's users or entry point, never by ``import deepnvme``:

* :mod:`.vllm`: ``load_format="deepnvme"`` (from the ``vllm.general_plugins`` entry point);
* :mod:`.lightning`: ``DeepNVMeCheckpointIO``, a Lightning ``CheckpointIO`` plugin;
* :mod:`.transformers`: ``from_pretrained``, ``save_pretrained`` and a ``Trainer`` subclass;
* :mod:`.accelerate`: ``install(accelerator)`` for ``save_state`` / ``load_state``.

The framework-free parts (option checks, the weight stream) live in :mod:`._weights` so they
are tested without the framework installed.
"""
