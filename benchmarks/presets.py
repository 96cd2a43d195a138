"""Model shapes shared by the scorer and trainer benchmarks, and their FLOP counts for MFU.

* ``small``: the 4-layer, 16-expert Qwen3-MoE the scorer benchmark has always used
  (vocabulary 32,768): cheap enough for CPU runs, launch-bound on a GPU.
* ``tiny``: the project's tiny policy shape (services/model/tiny.py; vocabulary 4,096).
* ``qwen3-30b-a3b``: Qwen3-30B-A3B's published shape (hidden 2,048, 32 query and 4 key-value
  heads of 128, 128 experts of 768 with top-8 routing, vocabulary 151,936) with fewer layers
  so that it fits one GPU: 12 layers is 8.1B parameters (the issue's measurement model), 4
  layers 3.1B, 1 layer 1.2B (what a 2-core CPU can time).

Weights are random (built from the config): speed and memory do not depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["PEAK_TFLOPS", "PRESETS", "build", "flops_per_pass", "peak_tflops"]

PRESETS: dict[str, dict] = {
    "small": dict(
        vocab_size=32_768,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
    ),
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}

# dense bf16 tensor-core peaks (TFLOP/s), by a substring of torch.cuda.get_device_name()
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.0}


def build(
    preset: str,
    *,
    layers: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention: str = "sdpa",
    max_positions: int = 32_768,
) -> Qwen3MoeForCausalLM:
    shape = dict(PRESETS[preset])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = Qwen3MoeConfig(
        **shape,
        norm_topk_prob=True,
        max_position_embeddings=max_positions,
        use_sliding_window=False,
        sliding_window=None,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    # built directly in the target dtype and on the device: an 8B model never exists in float32 on the host
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Qwen3MoeForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    return model.eval()


def flops_per_pass(config, lengths: Sequence[int], head_rows: int, *, training: bool = False) -> float:
    """Model FLOPs of forwards over sequences of ``lengths`` (one each) with the LM head over ``head_rows``
    rows: 2 per multiply-add of every weight a token touches (attention projections, its top-k experts,
    the router), causal attention (QK^T and PV over half the square), and the head. ``training``
    triples it (the backward costs twice the forward); recomputation is not counted, as MFU conventions go."""
    c = config
    d, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    per_layer = d * heads * hd * 2 + d * kv * hd * 2 + d * c.num_experts  # q, o; k, v; router
    per_layer += c.num_experts_per_tok * 3 * d * c.moe_intermediate_size
    tokens = sum(lengths)
    dense = 2.0 * per_layer * c.num_hidden_layers * tokens
    attention = sum(2.0 * 2 * n * n / 2 * heads * hd for n in lengths) * c.num_hidden_layers
    head = 2.0 * d * c.vocab_size * head_rows
    return (dense + attention + head) * (3 if training else 1)


def peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
