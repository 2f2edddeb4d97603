"""DiLoCo's outer loop: θ_global, pseudo-gradients, the outer optimizer and its round bookkeeping."""

from dilocod.diloco.outer import OuterConfig, OuterOptimizer, global_sha256, keeps_progress, rebase

__all__ = ["OuterConfig", "OuterOptimizer", "global_sha256", "keeps_progress", "rebase"]
