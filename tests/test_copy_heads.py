"""The hand-built copy heads (services/model/tiny.py::install_copy_heads): before any training the
tiny policy already says back an entity that stands in its context, any entity, and keeps that
through a checkpoint's save and load."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from pbsd.cli import app


@pytest.fixture(scope="module", params=[2, 4], ids=["grouped-kv", "kv-per-head"])
def copying(tiny_world, tmp_path_factory, request):
    out = tmp_path_factory.mktemp("copy-heads") / "tiny"
    made = CliRunner().invoke(
        app,
        ["model", "tiny", "--world", str(tiny_world), "--out", str(out), "--vocab-size", "1024"]
        + ["--entity-tokens", "--copy-heads", "--kv-heads", str(request.param)],
    )
    assert made.exit_code == 0, made.output
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == request.param
    return out


def _model_and_tokenizer(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


def test_an_untrained_policy_with_copy_heads_says_back_the_entity_in_its_context(copying, tiny_world):
    model, tok = _model_and_tokenizer(copying)  # through save and load: the tie must survive both
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    entities = [json.loads(x) for x in (tiny_world / "entities.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    right = 0
    for entity in rng.sample(entities, 40):
        name = rng.choice([entity["name"], f"kb://{entity['id']}"])
        (target,) = tok.encode(name)
        text = f"The question asks about {name}, so the next search is for"
        with torch.no_grad():
            logits = model(torch.tensor([tok.encode(text)])).logits[0, -1]
        right += int(logits.argmax()) == target
    assert right == 40
    # with two entities in view it names one of them, not a third (which one is SFT's to learn)
    for _ in range(20):
        a, b = rng.sample(entities, 2)
        ids = tok.encode(f"{a['name']} founded the label that {b['name']} ran; the founder is")
        with torch.no_grad():
            said = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        assert said in {tok.convert_tokens_to_ids(a["name"]), tok.convert_tokens_to_ids(b["name"])}


def test_an_untrained_policy_without_them_does_not(tiny_world, tmp_path):
    """The check above is not a property of any tiny model: the default initialisation names
    nothing in particular."""
    made = CliRunner().invoke(
        app,
        ["model", "tiny", "--world", str(tiny_world), "--out", str(tmp_path / "t"), "--vocab-size", "1024"]
        + ["--entity-tokens"],
    )
    assert made.exit_code == 0, made.output
    model, tok = _model_and_tokenizer(tmp_path / "t")
    entity = json.loads((tiny_world / "entities.jsonl").read_text().splitlines()[0])
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(f"about {entity['name']}, search for")])).logits[0, -1]
    assert int(logits.argmax()) != tok.convert_tokens_to_ids(entity["name"])


def test_copy_heads_need_entity_tokens(tiny_world, tmp_path):
    made = CliRunner().invoke(
        app,
        ["model", "tiny", "--world", str(tiny_world), "--out", str(tmp_path / "t"), "--vocab-size", "1024"]
        + ["--copy-heads"],
    )
    assert made.exit_code == 2 and "copy heads copy entity tokens: they need entity tokens" in made.stderr


def test_a_policy_step_keeps_the_embeddings_tied(copying):
    """A gradient step (AdamW over ``model.parameters()``, as the trainer's) moves one matrix for
    both ends: afterwards the input and output embeddings are still the same tensor, and it moved;
    the trainer's and workers' reload (``load_weights_into``) keeps the tie."""
    from services.model.checkpoint import load_weights_into

    model, tok = _model_and_tokenizer(copying)
    before = model.get_input_embeddings().weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([tok.encode("a short sentence about a founder and a city")])
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    embed = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == embed.data_ptr() and not torch.equal(embed, before)
    load_weights_into(model, copying)  # the trainer's reload path: back to the checkpoint, still tied
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_tied_checkpoint_carries_its_head_for_loaders_that_do_not_tie(copying, tmp_path):
    """SGLang's Qwen3-MoE reads lm_head.weight from the file and never ties it: the file must hold
    it (transformers alone would leave it out), and transformers must still load one tied matrix."""
    from safetensors.torch import load_file

    from services.model.checkpoint import load_model, save_checkpoint

    tensors = load_file(str(copying / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    model = load_model(copying)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        model.get_input_embeddings().weight[7] += 1.0  # a trained step, as the trainer publishes it
    save_checkpoint(model, tmp_path / "published")
    tensors = load_file(str(tmp_path / "published" / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors["lm_head.weight"], model.get_input_embeddings().weight)


def test_with_a_key_value_group_per_head_only_the_copy_heads_are_set(copying):
    """With grouped-query attention a copy head's key and value are its whole group's; with one
    group per head the last layer's other two heads keep their own, as initialised."""
    model, _ = _model_and_tokenizer(copying)
    attn, cfg = model.model.layers[-1].self_attn, model.config
    d = cfg.head_dim
    for group in range(cfg.num_key_value_heads):
        key = attn.k_proj.weight[group * d : (group + 1) * d]
        nonzero = int(torch.count_nonzero(key))
        assert (nonzero == 2) if group < 2 else (nonzero == key.numel())
