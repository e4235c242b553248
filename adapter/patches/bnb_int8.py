"""bitsandbytes' LLM.int8() linear on inputs of more than three dimensions.

`Linear8bitLt` hands its input to `bnb.matmul`, whose int8 path (bitsandbytes 0.50's default backend,
`int8_vectorwise_quant`) takes [tokens, features] or [batch, tokens, features]: a 4-D input fails there ("The size
of tensor a (128) must match the size of tensor b (16)"). transformers' GLM-4.7-Flash (glm4_moe_lite) and
Kimi-Linear call `kv_b_proj` on [batch, tokens, heads, rank], so Axolotl's 8-bit LoRA examples of both crashed at
their first forward. The quantisation is row-wise (one scale per row of the input), so running the rows flattened to
[rows, features] and shaping the output back is the same computation bitsandbytes does for a 3-D input."""
from __future__ import annotations

from adapter.patches import require

TESTED_BITSANDBYTES_VERSIONS = ("0.50.2",)
_PATCHED = "_nd_any_rank_input"


def int8_any_rank_input() -> None:
    """Before an 8-bit (LLM.int8()) base runs: Linear8bitLt takes inputs of any rank."""
    import bitsandbytes as bnb

    cls = bnb.nn.Linear8bitLt
    if getattr(cls.forward, _PATCHED, False):
        return
    require("bitsandbytes", TESTED_BITSANDBYTES_VERSIONS, "8-bit linear on 4-D inputs")
    forward = cls.forward

    def flat_forward(self, x):
        if x.dim() <= 3:
            return forward(self, x)
        out = forward(self, x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    setattr(flat_forward, _PATCHED, True)
    cls.forward = flat_forward


__all__ = ["int8_any_rank_input", "TESTED_BITSANDBYTES_VERSIONS"]
