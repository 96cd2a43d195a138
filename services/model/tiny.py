"""The tiny policy for CPU runs and tests: a byte-level BPE tokenizer trained on the world's
own text, and a randomly initialised Qwen3-MoE-architecture model built from a config.

Nothing is downloaded: the tokenizer learns its merges from the corpus, the system
prompt and the questions, and the model is ``Qwen3MoeForCausalLM(config)``, the same
class a real Qwen3-30B-A3B checkpoint loads into, just with 2 layers and 8 experts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TinySpec", "build_tiny_model", "train_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 16_384
    rope_theta: float = 100_000.0
    seed: int = 0
    # One token per entity name and per page address (kb://type/slug) on top of the BPE vocabulary:
    # copying a name from the question or a page is then copying one token, which one attention
    # head can learn; a name split into BPE pieces needs an induction circuit (a previous-token
    # head composed with a matching head), which a 2-layer model trained on 2 CPU cores for an
    # hour never formed (assets/demo-policy/RECIPE.md).
    entity_tokens: bool = False


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, whole: Iterable[str] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML special tokens, trained on ``texts``; each string in ``whole``
    becomes one more (non-special) token, matched before BPE wherever it occurs (longest first), so
    it always encodes to that one token and decodes back to itself."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # sorted: the ids do not depend on the order the caller found the strings in
    tok.add_tokens([AddedToken(w, normalized=False) for w in sorted(set(whole))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, spec: TinySpec = TinySpec()) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * 2,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config)
    model.config.pbsd_tiny_spec = asdict(spec)
    return model.eval()


def _digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode() + b"\x00")
    return h.hexdigest()


def init_tiny(world_dir, out, *, sft_data=None, spec: TinySpec = TinySpec(), date: str | None = None):
    """Train the tokenizer on a world (its corpus, questions, the system prompt, and SFT conversations
    when given), build the tiny model, and save both as a checkpoint at ``out``."""
    import json
    from pathlib import Path

    from agent.prompt import system_prompt
    from services.model.checkpoint import library_versions, save_checkpoint
    from services.tools.catalogue import catalogue

    root = Path(world_dir)
    date = date or json.loads((root / "manifest.json").read_text()).get("date")
    texts = [json.loads(line)["text"] for line in (root / "corpus.jsonl").read_text().splitlines()]
    for split in ("rl", "validation", "sft"):
        path = root / "questions" / f"{split}.jsonl"
        if path.exists():
            texts += [json.loads(line)["question"] for line in path.read_text().splitlines()]
    # The system prompt opens every conversation: it appears often enough here for BPE to learn its
    # words (min_frequency 2), so it costs hundreds of tokens, not thousands.
    texts += [system_prompt(catalogue(), date)] * 64
    if sft_data is not None:
        for line in Path(sft_data).read_text().splitlines():
            texts += [m["content"] for m in json.loads(line)["messages"][1:]]
    whole = []
    if spec.entity_tokens:
        for line in (root / "entities.jsonl").read_text().splitlines():
            entity = json.loads(line)
            whole += [entity["name"], f"kb://{entity['id']}"]
    tokenizer = train_tokenizer(texts, spec.vocab_size, whole)
    model = build_tiny_model(tokenizer, spec)
    return save_checkpoint(
        model,
        out,
        tokenizer=tokenizer,
        meta={
            "tiny_spec": asdict(spec),
            "world": str(root),
            "libraries": library_versions(),
            # what the tokenizer learnt its merges from: a rebuild with another digest saw other text
            "tokenizer_text_sha256": _digest(texts),
        },
    )
