"""Block expansion (``pbsd model grow``): added layers change nothing until they learn, and the note
pass can train them alone."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from pbsd.cli import app
from services.model.checkpoint import load_model
from services.model.grow import grow, grow_checkpoint, train_only
from services.trainer.note_pass import NotePassConfig, run_note_pass
from worldgen.oracle import write_sft_data


def _ids(model, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, n), generator=g)


@pytest.mark.parametrize(("count", "after"), [(1, -1), (2, -1), (1, 0)])
def test_added_layers_leave_the_logits_as_they_were(moe_checkpoint, count, after):
    model = load_model(moe_checkpoint)
    ids = _ids(model)
    with torch.no_grad():
        before = model(ids).logits
        added = grow(model, count, after=after)
        after_logits = model(ids).logits
    n = model.config.num_hidden_layers
    assert n == 2 + count and len(model.model.layers) == n
    assert added == list(range(after % 2 + 1, after % 2 + 1 + count))
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(n))
    assert torch.equal(before, after_logits)  # exactly: each added layer adds zeros to the residual
    assert all(layer.self_attn.config is model.config for layer in model.model.layers)


def test_biases_are_silenced_too_and_dense_models_refused(moe_checkpoint):
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    config = AutoConfig.from_pretrained(moe_checkpoint)
    config.attention_bias = True
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.self_attn.o_proj.bias.data.normal_(0, 0.5)  # a bias the added copy must not write
    ids = _ids(model)
    with torch.no_grad():
        before = model(ids).logits
        grow(model, 1)
        assert torch.equal(before, model(ids).logits)
    dense = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        grow(dense, 1)


def test_the_key_value_cache_holds_a_slot_for_every_layer(moe_checkpoint):
    model = load_model(moe_checkpoint)
    ids = _ids(model)
    grow(model, 2, source=0)
    model.model.layers[2].self_attn.o_proj.weight.data.normal_(0, 0.2)  # the added layer now writes
    with torch.no_grad():
        whole = model(ids).logits[0, 60:]
        cache = model(ids[:, :60], use_cache=True).past_key_values
        stepped = model(ids[:, 60:], cache=cache, use_cache=True).logits[0]
    assert len(cache.layers) == 4
    torch.testing.assert_close(stepped, whole, atol=1e-4, rtol=1e-4)


def test_bad_growth_is_refused(moe_checkpoint):
    model = load_model(moe_checkpoint)
    with pytest.raises(ValueError, match="after=2"):
        grow(model, 1, after=2)
    with pytest.raises(ValueError, match="source=-3"):
        grow(model, 1, source=-3)
    with pytest.raises(ValueError, match="at least one"):
        grow(model, 0)
    model.config.layer_types = ["full_attention"] * 2  # per-layer lists grow() does not renumber
    with pytest.raises(ValueError, match="layers are all alike"):
        grow(model, 1)
    del model.config.layer_types
    with pytest.raises(ValueError, match=r"layers 0\.\.1"):
        train_only(model, [2])


def test_training_the_added_layers_moves_only_them(moe_checkpoint):
    model = load_model(moe_checkpoint)
    grow(model, 1)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("model.layers.2.")}
    learning = train_only(model, [2])
    assert learning == sum(p.numel() for p in model.model.layers[2].parameters())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = _ids(model)
    with torch.no_grad():
        start = model(ids).logits
    below = []  # what the frozen layer under the added one hands up: no graph, so backward stops there
    model.model.layers[1].register_forward_hook(lambda module, args, out: below.append(out))
    for _ in range(3):  # the zeroed output projections get a gradient first, then the rest
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).backward()
        opt.step()
    hidden = [o[0] if isinstance(o, tuple) else o for o in below]
    assert len(hidden) == 3 and not any(h.requires_grad for h in hidden)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())
    assert model.model.layers[2].self_attn.o_proj.weight.abs().sum() > 0
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, start)


def test_a_grown_checkpoint_reloads_and_the_note_pass_trains_its_added_layers(
    tiny_checkpoint, tiny_world, tmp_path
):
    record = grow_checkpoint(tiny_checkpoint, tmp_path / "grown", 1)
    assert record == {"added": [2], "source": 1, "layers_before": 2}
    original, grown = load_model(tiny_checkpoint), load_model(tmp_path / "grown")
    ids = _ids(original)
    with torch.no_grad():
        assert torch.equal(original(ids).logits, grown(ids).logits)
    assert json.loads((tmp_path / "grown" / "pbsd.json").read_text())["grown"] == record
    again = grow_checkpoint(tmp_path / "grown", tmp_path / "grown-twice", 2, after=0)
    assert again == {"added": [1, 2, 4], "source": 0, "layers_before": 3}  # the first one's layer 2 is now 4

    data = tmp_path / "sft.jsonl"
    write_sft_data(tiny_world, data, split="sft", limit=4, search_num=3)
    config = NotePassConfig(
        steps=2, batch_size=2, anchors=1, lr=3e-3, warmup_steps=1, limit=4, train_layers=(2,)
    )
    run_note_pass(data, tmp_path / "grown", tmp_path / "taught", config)
    taught = load_model(tmp_path / "taught").state_dict()
    for name, weight in grown.state_dict().items():
        assert torch.equal(weight, taught[name]) != name.startswith("model.layers.2."), name


def test_the_commands_grow_and_train_the_grown_layers(tiny_checkpoint, tiny_world, tmp_path):
    runner = CliRunner()
    grown = tmp_path / "grown"
    result = runner.invoke(
        app, ["model", "grow", "--model", str(tiny_checkpoint), "--out", str(grown), "--layers", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "4 layers, [2, 3] added as copies of layer 1" in result.output
    data = tmp_path / "sft.jsonl"
    write_sft_data(tiny_world, data, split="sft", limit=3, search_num=3)
    teach = [
        "teacher",
        "teach",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "t"),
        "--steps",
        "1",
        "--limit",
        "3",
    ]
    result = runner.invoke(app, [*teach, "--model", str(grown), "--train-layers", "grown"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "t" / "pbsd.json").read_text())["note_pass"]["config"]["train_layers"] == [
        2,
        3,
    ]
