"""Preconditioned KDA (PKDA): naive oracle, chunked reference, Triton forward, public op."""
from .naive import naive_recurrent_precond_kda

__all__ = ["naive_recurrent_precond_kda", "chunk_precond_kda", "fused_recurrent_precond_kda"]


def __getattr__(name):  # import the Triton op lazily: `import kernels.pkda` stays cheap
    if name == "chunk_precond_kda":
        from .op import chunk_precond_kda
        return chunk_precond_kda
    if name == "fused_recurrent_precond_kda":
        from .recurrent import fused_recurrent_precond_kda
        return fused_recurrent_precond_kda
    raise AttributeError(name)
