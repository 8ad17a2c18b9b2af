"""Optimizer state offload to NVMe (ZeRO-Infinity style) for any torch optimizer."""

from .nvme_optimizer import NVMeOptimizer

__all__ = ["NVMeOptimizer"]
