"""The tiny policy for CPU runs and tests: a byte-level BPE tokenizer trained on the world's
own text, and a randomly initialised Qwen3-MoE-architecture model built from a config.

Nothing is downloaded: the tokenizer learns its merges from the corpus, the system
prompt and the questions, and the model is ``Qwen3MoeForCausalLM(config)``, the same
class a real Qwen3-30B-A3B checkpoint loads into, just with 2 layers and 8 experts
(and, with ``copy_heads``, tied embeddings and two attention heads set by hand).
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


COPY_HEADS = 2  # copy heads in the last layer, each the first head of its own key-value group


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
    # Hand-built copy heads (needs entity_tokens; ties the input and output embeddings): see
    # install_copy_heads. Without them the model has to learn in-context copying from scratch,
    # which it does not do in CPU time even for single tokens.
    copy_heads: bool = False

    def __post_init__(self) -> None:
        # each refused shape wrote a checkpoint that failed at its first forward
        if self.hidden_size % 4:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of 4 (row strides of 16 bytes)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_key_value_heads} key-value groups do not divide {self.num_attention_heads} heads"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"top-{self.num_experts_per_tok} routing needs at least as many experts, not {self.num_experts}"
            )
        if self.copy_heads and not self.entity_tokens:
            raise ValueError("copy heads copy entity tokens: they need entity tokens")
        width = min(COPY_HEADS, self.num_key_value_heads) * self.head_dim
        if self.copy_heads and (self.num_hidden_layers < 2 or self.hidden_size < width + 18):
            raise ValueError(f"copy heads need 2+ layers and a hidden size of at least {width + 18}")


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
        tie_word_embeddings=spec.copy_heads,
        use_sliding_window=False,
        sliding_window=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(config)
    if spec.copy_heads:
        if not spec.entity_tokens:
            raise ValueError("copy_heads copies entity tokens: it needs entity_tokens")
        install_copy_heads(model, entity_ids(tokenizer), seed=spec.seed)
    model.config.pbsd_tiny_spec = asdict(spec)
    return model.eval()


def entity_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids of the whole-name tokens added after BPE (train_tokenizer's ``whole``)."""
    special = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return sorted(i for i in tokenizer.get_added_vocab().values() if i not in special)


def install_copy_heads(model: Qwen3MoeForCausalLM, entity_ids: list[int], *, seed: int = 0) -> None:
    """Make the first head of each of the last layer's first two key-value groups copy entity tokens.

    What a pre-trained base brings and a 2-layer model trained from nothing on 2 cores never
    learns (assets/demo-policy/RECIPE.md): reading a name back from the context. With every
    entity one token (``entity_tokens``) and tied embeddings, copying is one head, built here:

    - embeddings: entity ``e`` is a random unit vector ``u_e`` in the first ``C*d`` dimensions
      (C copy heads of head size d), every other token a random unit vector in the
      dimensions after ``C*d + 2``; every token has 0.5 in dimension ``C*d`` (a constant the
      query reads) and entities 0.5 in dimension ``C*d + 1`` (a flag the key reads);
    - the head of group g: its query is that constant and its key the flag, in the RoPE pair
      of lowest frequency (nearly position-blind), scaled so an entity outscores any other
      token by ~20; its value and output are the identity on dims ``g*d .. g*d+d-1`` of ``u``;
    - the output embedding is the input one (tied), so the residual's copy of ``u_e`` raises
      the logit of ``e`` itself over every other entity (random unit vectors in ``C*d``
      dimensions, 64 here, are nearly orthogonal).

    A head shares its key and value with the other heads of its group, so with grouped-query
    attention every head of a copy head's group starts out reading entities too. With as many
    key-value groups as heads (``TinySpec.num_key_value_heads``) the last layer keeps heads of
    its own for everything else, such as which relation the question asks for.

    So from the first step the model can say any entity in its context, including names it
    never saw in training, and SFT only has to learn which one (the query and key) and when.
    On a synthetic task (name the entity that follows a given relation token, half the entity
    ids never seen in training) this initialisation reached 0.98 on the unseen ids in 50
    steps; the default one, on the easier task of naming the last entity, was still at 0 on
    unseen ids after 600 steps, with tied embeddings or not (assets/demo-policy/RECIPE.md).
    """
    cfg = model.config
    d, groups, hidden = cfg.head_dim, cfg.num_key_value_heads, cfg.hidden_size
    per_group = cfg.num_attention_heads // groups
    copies = min(COPY_HEADS, groups)
    width = copies * d  # dims 0 .. width-1 carry an entity's identity
    const, flag = width, width + 1
    if hidden < width + 2 + 16 or cfg.num_hidden_layers < 2 or not cfg.tie_word_embeddings:
        raise ValueError(
            "copy heads need tied embeddings, 2+ layers and hidden_size >= copy heads * head_dim + 18"
        )
    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings().weight
    ents = torch.tensor(entity_ids)

    def unit(n: int, dims: int) -> torch.Tensor:
        v = torch.randn(n, dims, generator=g)
        return v / v.norm(dim=1, keepdim=True)

    # RoPE pairs dimension i with i + d/2 at frequency theta^(-2i/d): the last pair turns least
    low, low2 = d // 2 - 1, d // 2 - 2
    score = 20.0  # an entity's attention logit over any other token's
    attn = model.model.layers[-1].self_attn
    with torch.no_grad():
        embed.zero_()
        embed[:, flag + 1 :] = unit(embed.shape[0], hidden - flag - 1)
        embed[ents] = 0.0
        embed[ents, :width] = unit(len(ents), width)
        embed[:, const] = 0.5
        embed[ents, flag] = 0.5
        for group in range(copies):
            head = group * per_group
            q = attn.q_proj.weight[head * d : (head + 1) * d]
            q.zero_()
            q[low, const] = 1.0
            k = attn.k_proj.weight[group * d : (group + 1) * d]
            k.zero_()
            k[low, flag] = 1.0
            k[low2, const] = 1.0  # non-entities get a key too, orthogonal to the query (k_norm)
            v = attn.v_proj.weight[group * d : (group + 1) * d]
            v.zero_()
            v[:, group * d : (group + 1) * d] = torch.eye(d)
            o = attn.o_proj.weight[:, head * d : (head + 1) * d]
            o.zero_()
            o[group * d : (group + 1) * d] = torch.eye(d)
        # after q_norm the query is sqrt(d) in one dimension, an entity's key sqrt(d/2); the
        # score is their product over sqrt(d), times both norms' weights
        norm_weight = (score / (d / 2) ** 0.5) ** 0.5
        attn.q_norm.weight.fill_(norm_weight)
        attn.k_norm.weight.fill_(norm_weight)
        model.model.norm.weight.fill_(2.0)  # logits of ~20 for the copied entity


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

    from agent.catalogue import catalogue
    from agent.prompt import system_prompt
    from services.model.checkpoint import library_versions, save_checkpoint

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
