"""Plugins for other frameworks. Each integration module imports its framework and is imported
only by that framework's entry point (``vllm.general_plugins`` -> :mod:`.vllm`), never by
``import deepnvme``. The framework-free parts (option checks, the weight stream) live in
:mod:`._weights` so they are tested without the framework installed.
"""
