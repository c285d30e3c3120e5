"""LoRA on the tiny Qwen2.5-VL: where adapters go, what trains, the disabled-adapter reference, save / load /
merge round trips, and vision freezing with full fine-tuning."""

import json

import pytest
import torch
from PIL import Image

from vlm_grpo_ma.model import lora
from vlm_grpo_ma.model.loading import load_policy, resolve_model_path
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.prompts import encode_prompt
from vlm_grpo_ma.task_api.registry import Sample

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4
# tiny text decoder, per layer (in, out): q 128->128, k 128->64, v 128->64, o 128->128, gate/up 128->384,
# down 384->128; 4 layers.
TINY_LORA_PARAMS_PER_RANK = 4 * ((128 + 128) + (128 + 64) * 2 + (128 + 128) + (128 + 384) * 3)  # 9,728


@pytest.fixture
def policy(untrained_tiny_dir):
    """A fresh policy per test: apply_lora changes the model in place."""
    loaded = load_policy(str(untrained_tiny_dir), attn_implementation="sdpa")
    loaded.model.eval()
    return loaded


def _batch(policy):
    colours = [(220, 30, 30), (30, 200, 40)]
    samples = [
        Sample(
            "grounding",
            str(i),
            "Locate: the red circle" + " please" * i,
            (Image.new("RGB", (168, 112), c),),
            [0, 0, 1, 1],
        )
        for i, c in enumerate(colours)
    ]
    prompts = [encode_prompt(policy, s, "Think.") for s in samples]
    texts = [
        "<think>the small red circle</think><answer>[1,2,3,4]</answer>",
        "<think>left</think><answer>[5,6]</answer>",
    ]
    completions = [policy.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return prompts, [0, 1], completions


def _logprobs(policy, batch, *, grad=False):
    with torch.set_grad_enabled(grad):
        return sequence_logprobs(policy, *batch, temperature=1.0)


def _apply(policy, targets=TARGETS):
    policy.adapter = lora.apply_lora(policy.model, rank=RANK, alpha=8.0, dropout=0.0, target_modules=targets)
    return policy.adapter


def _train_step(policy, batch, lr=0.05):
    """One Adam step on the trainable parameters, so that LoRA B leaves zero."""
    optimizer = torch.optim.Adam(lora.trainable_parameters(policy.model), lr=lr)
    optimizer.zero_grad()
    (-_logprobs(policy, batch, grad=True).sum()).backward()
    optimizer.step()


def _max_diff(a, b):
    return float((a - b).abs().max())


def test_adapters_go_only_to_language_model_targets(policy):
    linears = {n: m for n, m in policy.model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision_linears = [n for n in linears if n.startswith("model.visual.")]
    # the vision MLP shares the suffixes gate_proj/up_proj/down_proj: suffix matching alone would adapt it
    assert any(n.endswith(".gate_proj") for n in vision_linears)
    expected = sorted(
        n for n in linears if n.startswith("model.language_model.") and n.rsplit(".", 1)[-1] in TARGETS
    )
    total_before = sum(p.numel() for p in policy.model.parameters())

    _apply(policy)

    adapted = sorted(lora.adapted_module_names(policy.model))
    assert adapted == expected and len(adapted) == 4 * 7
    assert not [n for n in adapted if n.startswith("model.visual")]
    assert all(type(policy.model.get_submodule(n)) is torch.nn.Linear for n in vision_linears)
    assert type(policy.model.lm_head) is torch.nn.Linear
    for name, p in policy.model.named_parameters():
        assert p.requires_grad == (".lora_A." in name or ".lora_B." in name), name
    trainable, total = lora.parameter_counts(policy.model)
    from_shapes = sum(RANK * (linears[n].in_features + linears[n].out_features) for n in expected)
    assert trainable == from_shapes == RANK * TINY_LORA_PARAMS_PER_RANK == 38_912
    assert total == total_before + trainable
    assert sum(p.numel() for p in lora.trainable_parameters(policy.model)) == trainable
    assert "38,912 of" in lora.describe_parameters(policy.model)


def test_subset_of_targets_and_unknown_target(policy, untrained_tiny_dir):
    _apply(policy, ["q_proj", "v_proj"])
    assert (
        sorted(n.rsplit(".", 1)[-1] for n in lora.adapted_module_names(policy.model))
        == ["q_proj"] * 4 + ["v_proj"] * 4
    )
    with pytest.raises(ValueError, match="already carries LoRA"):
        _apply(policy)
    fresh = load_policy(str(untrained_tiny_dir), attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"\['qkv'\].*q_proj"):  # a vision-only name is not a language target
        lora.apply_lora(fresh.model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "qkv"])
    assert lora.adapted_module_names(fresh.model) == []


def test_zero_init_then_trained_then_disabled_gives_the_base_policy(policy):
    batch = _batch(policy)
    base = _logprobs(policy, batch)
    _apply(policy)
    assert torch.equal(_logprobs(policy, batch), base)  # LoRA B = 0 at init: exactly the base model

    _train_step(policy, batch)
    trained = _logprobs(policy, batch)
    assert _max_diff(trained, base) > 1e-2
    with lora.adapters_disabled(policy):
        assert _max_diff(_logprobs(policy, batch), base) <= 1e-6
    assert torch.equal(_logprobs(policy, batch), trained)  # switched back on after the block
    with pytest.raises(RuntimeError), lora.adapters_disabled(policy.adapter):
        raise RuntimeError("inside")
    assert torch.equal(_logprobs(policy, batch), trained)  # and after an error in the block


def test_adapters_disabled_needs_an_adapter(policy):
    with pytest.raises(ValueError, match="no LoRA adapter"), lora.adapters_disabled(policy):
        pass


def test_backward_reaches_only_adapter_parameters(policy):
    batch = _batch(policy)
    _apply(policy)
    lora.freeze_vision(policy.model)
    (-_logprobs(policy, batch, grad=True).sum()).backward()
    for name, p in policy.model.named_parameters():
        if ".lora_" in name:
            assert p.grad is not None, name
        else:
            assert p.grad is None, name
    # B = 0 at init: dL/dA is exactly 0 and every B gets a non-zero gradient
    grads_b = [p.grad for n, p in policy.model.named_parameters() if ".lora_B." in n]
    assert len(grads_b) == 28 and all(float(g.abs().sum()) > 0 for g in grads_b)


def test_freeze_vision_with_full_fine_tuning(policy):
    batch = _batch(policy)
    frozen = lora.freeze_vision(policy.model)
    vision = {id(p) for p in policy.model.model.visual.parameters()}
    assert frozen == sum(p.numel() for p in policy.model.model.visual.parameters()) > 0
    trainable, total = lora.parameter_counts(policy.model)
    assert trainable == total - frozen
    (-_logprobs(policy, batch, grad=True).sum()).backward()
    for name, p in policy.model.named_parameters():
        if id(p) in vision:
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.requires_grad, name
    language = [p for n, p in policy.model.named_parameters() if n.startswith("model.language_model.layers.")]
    assert language and all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in language)


def test_save_load_merge_round_trip(policy, untrained_tiny_dir, tmp_path):
    batch = _batch(policy)
    _apply(policy)
    _train_step(policy, batch)
    policy.model.eval()
    adapted = _logprobs(policy, batch)

    folder = tmp_path / "checkpoint" / "model"
    lora.save_model(policy, folder)
    policy.processor.save_pretrained(folder)
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert not (folder / "model.safetensors").exists()
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(untrained_tiny_dir.resolve())

    loaded = load_policy(str(folder), attn_implementation="sdpa")
    loaded.model.eval()
    assert type(loaded.model) is type(policy.model) and loaded.adapter is not None
    assert sorted(lora.adapted_module_names(loaded.model)) == sorted(lora.adapted_module_names(policy.model))
    # the adapter is trainable again after loading (resume), the base frozen
    assert lora.parameter_counts(loaded.model) == lora.parameter_counts(policy.model)
    assert torch.equal(_logprobs(loaded, batch), adapted)
    with lora.adapters_disabled(loaded):
        with lora.adapters_disabled(policy):
            assert _max_diff(_logprobs(loaded, batch), _logprobs(policy, batch)) <= 1e-6

    merged_dir = lora.merge_adapter(folder, tmp_path / "merged")
    assert not (merged_dir / "adapter_config.json").exists()
    merged = load_policy(str(merged_dir), attn_implementation="sdpa")
    merged.model.eval()
    assert merged.adapter is None and lora.adapted_module_names(merged.model) == []
    assert _max_diff(_logprobs(merged, batch), adapted) <= 1e-5
    assert _max_diff(_logprobs(merged, batch), _logprobs(load_policy(str(untrained_tiny_dir)), batch)) > 1e-2


def test_full_fine_tuning_saves_a_full_model(policy, tmp_path):
    lora.save_model(policy, tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert not (tmp_path / "model" / "adapter_config.json").exists()


def test_adapter_of_the_embedded_model_names_a_loadable_base(tmp_path):
    policy = load_policy("tiny", attn_implementation="sdpa")
    _apply(policy, ["q_proj"])
    lora.save_model(policy, tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    assert config["base_model_name_or_path"] == resolve_model_path("tiny")
    config["base_model_name_or_path"] = "tiny"  # the config name works too; no processor here: the base's
    config_path.write_text(json.dumps(config))
    loaded = load_policy(str(tmp_path / "adapter"), attn_implementation="sdpa")
    assert loaded.adapter is not None and len(lora.adapted_module_names(loaded.model)) == 4


def test_adapter_with_a_missing_base_is_a_clear_error(policy, tmp_path):
    _apply(policy, ["q_proj"])
    lora.save_model(policy, tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    config_path.write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="base model of the LoRA adapter.*gone"):
        load_policy(str(tmp_path / "adapter"))


def test_merge_cli_rejects_a_folder_that_is_not_an_adapter(untrained_tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lora.main(["merge", str(untrained_tiny_dir), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{untrained_tiny_dir} is not a LoRA adapter folder" in err and "adapter_config.json" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_info:
        lora.main(["merge", str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "nowhere: no such folder" in capsys.readouterr().err


def test_targets_the_loaded_model_lacks_are_a_config_error_not_a_traceback(tiny_policy):
    """A model architectures.py cannot describe (a hub id it has no entry for) has its targets checked once
    loaded, by apply_lora, whose ValueError reached the train command as a traceback. Planted: the try around
    apply_lora in setup.configure_trainable removed; a ValueError, not a ConfigError (train's one-line path)."""
    from vlm_grpo_ma.run.config import ConfigError
    from vlm_grpo_ma.run.config_files import load_config
    from vlm_grpo_ma.run.setup import configure_trainable

    cfg = load_config(None, ["model.lora_rank=2", "model.lora_target_modules=[q_proj,qkv]"])
    with pytest.raises(ConfigError, match=r"^model.lora_target_modules=\['q_proj', 'qkv'\]: LoRA target_modules \['qkv'\] match no Linear"):
        configure_trainable(tiny_policy, cfg)
    assert tiny_policy.adapter is None and lora.adapted_module_names(tiny_policy.model) == []
