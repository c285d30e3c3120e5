"""LoRA adapters (peft) on the language model, vision freezing, and adapter save / load / merge.

Design decisions:
- peft injects its LoRA layers *in place* into the model's Linear modules, so ``policy.model`` stays the
  original ``Qwen*VLForConditionalGeneration`` and every call site (``policy.model.model(...)``,
  ``policy.model.lm_head``, ``get_rope_index`` ...) keeps working unchanged. The ``PeftModel`` wrapper is kept
  next to it as ``policy.adapter``: it owns the adapter config, ``disable_adapter()`` and ``save_pretrained``.
- Only the language model gets adapters. Qwen2.5-VL's vision blocks also have ``gate_proj/up_proj/down_proj``
  MLPs, so peft's suffix matching on a plain list would adapt them too; the targets are therefore one regex
  anchored at the language model's module path (peft full-matches a string ``target_modules``).
- The KL reference with LoRA is the base model computed with the adapters switched off (``adapters_disabled``):
  no second copy of the weights in memory.
- An adapter folder records the base model it was trained on in ``base_model_name_or_path`` (a resolved,
  absolute local path or a hub id), so ``load_policy`` and standard peft tooling can find it again.
- ``lora_dropout > 0`` makes training log-probs (train mode) differ from sampling log-probs (eval mode); the
  project's default is 0 (see ARCHITECTURE.md: dropout is off).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

ADAPTER_CONFIG_NAME = "adapter_config.json"  # peft's file name (peft.utils.CONFIG_NAME)
# Qwen3.5's Gated DeltaNet layers (3 of every 4) mix tokens through these, not q/k/v/o_proj: the fused query,
# key and value projection, the output gate and the output. (in_proj_a / in_proj_b give one decay and one write
# strength per head: too narrow for a rank-r adapter to help.)
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# Where things live in a Qwen-VL model (transformers 5: model.model.visual, model.model.language_model)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision encoder (patch embedding, blocks and the merger into the text width)."""
    inner = getattr(model, "model", model)
    visual = getattr(inner, "visual", None)
    if not isinstance(visual, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no vision tower at .model.visual")
    return visual


def _module_path(model: torch.nn.Module, module: torch.nn.Module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def language_model_path(model: torch.nn.Module) -> str:
    """Dotted module path of the text decoder, e.g. ``model.language_model``."""
    inner = getattr(model, "model", model)
    language_model = getattr(inner, "language_model", None)
    if not isinstance(language_model, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no text decoder at .model.language_model")
    return _module_path(model, language_model)


def check_target_modules(name_or_path: str, target_modules: Sequence[str]) -> None:
    """ValueError of one line when ``target_modules`` name a projection that the decoder of model
    ``name_or_path`` (a folder, ``tiny`` or a published id) does not have, found from its config.json before
    any weights load. A model whose architecture is not known here is checked by ``apply_lora`` once loaded."""
    from vlm_grpo_ma.model import architectures

    try:
        valid = architectures.decoder_projections(architectures.architecture_of(name_or_path))
    except (ValueError, OSError, KeyError):  # a hub id not described here, a config.json without the widths
        return
    missing = [s for s in target_modules if s not in valid]
    if missing or not target_modules:
        problem = f"{missing} match no projection of" if missing else "names no projection of"
        raise ValueError(
            f"model.lora_target_modules={list(target_modules)}: {problem} the decoder of {name_or_path}; its"
            f" projections are: {', '.join(valid)}"
        )


def _target_regex(prefix: str, suffixes: Sequence[str]) -> str:
    alternatives = "|".join(re.escape(s) for s in suffixes)
    return rf"{re.escape(prefix)}\.(?:.*\.)?(?:{alternatives})"


# ----------------------------------------------------------------------------------------------------------
# Freezing and counting


def freeze_vision(model: torch.nn.Module) -> int:
    """Stop training the vision tower (and its merger). Returns the number of parameters frozen."""
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimiser should update (tied weights appear once)."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; LoRA weights count in both."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def describe_parameters(model: torch.nn.Module) -> str:
    trainable, total = parameter_counts(model)
    return f"{trainable:,} of {total:,} parameters trainable ({100.0 * trainable / max(total, 1):.2f}%)"


def adapted_module_names(model: torch.nn.Module) -> list[str]:
    """Module paths (in ``model``'s own naming) of the layers that carry a LoRA adapter."""
    from peft.tuners.lora import LoraLayer

    return [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]


# ----------------------------------------------------------------------------------------------------------
# Applying, disabling, saving


def apply_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model_name_or_path: str | None = None,
):
    """Add LoRA adapters to the language model's Linear layers whose names end in ``target_modules`` and
    freeze every base weight. ``model`` is changed in place and stays usable as before; the returned
    ``PeftModel`` (store it as ``policy.adapter``) saves the adapter and switches it off.

    ``base_model_name_or_path`` is recorded in the adapter config; by default the folder or hub id the model
    was loaded from. LoRA B starts at zero, so the adapted model computes exactly the base model at first.
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not target_modules:
        raise ValueError("LoRA target_modules is empty")
    if adapted_module_names(model):
        raise ValueError("the model already carries LoRA adapters (loaded from an adapter checkpoint?)")
    prefix = language_model_path(model)
    linear_names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith(prefix + ".")
    ]
    missing = [s for s in target_modules if not any(n.endswith("." + s) for n in linear_names)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in linear_names})
        raise ValueError(
            f"LoRA target_modules {missing} match no Linear layer of the language model; its layer names end in: "
            + ", ".join(known)
        )
    linear_attention = {n.rsplit(".", 1)[-1] for n in linear_names} & set(LINEAR_ATTENTION_TARGETS)
    if linear_attention and not linear_attention & set(target_modules):
        log.warning(
            "LoRA targets %s adapt no linear-attention layer: their token mixing (3 of every 4 layers of a hybrid "
            "model) stays frozen; add %s to model.lora_target_modules to train it",
            list(target_modules), ", ".join(LINEAR_ATTENTION_TARGETS),
        )
    base = base_model_name_or_path or getattr(model, "name_or_path", "") or None
    if base is not None and Path(base).expanduser().is_dir():
        base = str(Path(base).expanduser().resolve())
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=_target_regex(prefix, target_modules),
        bias="none",
    )
    adapter = get_peft_model(model, config)  # freezes all non-LoRA weights, vision tower included
    adapter.peft_config[adapter.active_adapter].base_model_name_or_path = base
    return adapter


def _adapter_of(policy_or_adapter):
    adapter = getattr(policy_or_adapter, "adapter", policy_or_adapter)
    if adapter is None or not hasattr(adapter, "disable_adapter"):
        raise ValueError(
            "no LoRA adapter on this policy: the base (reference) policy is not available by switching adapters"
            " off; with full fine-tuning load a separate reference model"
        )
    return adapter


@contextlib.contextmanager
def adapters_disabled(policy_or_adapter) -> Iterator[None]:
    """Within the block, ``policy.model`` computes the base model (the KL reference): LoRA layers return
    their base layer's output only. Adapters are switched back on when the block exits, even on error."""
    with _adapter_of(policy_or_adapter).disable_adapter():
        yield


def adapter_state_names(adapter, state: dict) -> set[str]:
    """The names in ``state`` (``adapter.state_dict()``'s, possibly sharded) that ``adapter.save_pretrained``
    writes, chosen by peft's own rule (``get_peft_model_state_dict``, which only selects and renames: it is
    handed each name as its own value, so no tensor is read)."""
    from peft import get_peft_model_state_dict

    chosen = get_peft_model_state_dict(adapter, state_dict={name: name for name in state}, save_embedding_layers=False)
    return set(chosen.values())


def save_model(policy, folder: str | Path) -> Path:
    """Write ``policy``'s weights to ``folder``: only the adapter (``adapter_config.json`` + adapter weights,
    naming the base model) when LoRA is on, else the full model. The processor is the caller's to save."""
    folder = Path(folder)
    if policy.adapter is None:
        policy.model.save_pretrained(folder)
        return folder
    config = policy.adapter.peft_config[policy.adapter.active_adapter]
    if not config.base_model_name_or_path:
        raise ValueError(
            "the LoRA adapter names no base model (the model was not loaded from a folder or hub id); pass"
            " base_model_name_or_path to apply_lora"
        )
    # embeddings are never adapted here; "auto" would look the base model up on the hub to decide
    policy.adapter.save_pretrained(folder, save_embedding_layers=False)
    return folder


# ----------------------------------------------------------------------------------------------------------
# Merging


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG_NAME).is_file()


def merge_adapter(adapter_folder: str | Path, out_folder: str | Path, *, dtype: str | None = None) -> Path:
    """Fold the adapter into its base model's weights and write a plain model folder (weights, config,
    generation config, processor) that loads without peft. The merge is computed in float32; the weights are
    written in ``dtype`` (default: the dtype the base model was stored in)."""
    from transformers import AutoConfig

    from vlm_grpo_ma.model.loading import load_policy, resolve_model_path

    adapter_folder, out_folder = Path(adapter_folder), Path(out_folder)
    if not is_adapter_folder(adapter_folder):
        raise ValueError(f"{adapter_folder} is not a LoRA adapter folder (no {ADAPTER_CONFIG_NAME})")
    policy = load_policy(str(adapter_folder), dtype="float32", attn_implementation="sdpa")
    if dtype is None:
        base = policy.adapter.peft_config[policy.adapter.active_adapter].base_model_name_or_path
        stored = getattr(AutoConfig.from_pretrained(resolve_model_path(base)), "dtype", None)
        dtype = str(stored).removeprefix("torch.") if stored is not None else "float32"
    merged = policy.adapter.merge_and_unload(safe_merge=True)  # the same model object, LoRA layers replaced
    merged.to(getattr(torch, dtype))
    merged.save_pretrained(out_folder)
    policy.processor.save_pretrained(out_folder)
    return out_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo_ma.lora", description="LoRA adapter tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser(
        "merge", help="fold an adapter into its base model; write a plain model folder"
    )
    merge.add_argument(
        "adapter_dir", type=Path, help="a folder with adapter_config.json (e.g. a checkpoint's model/)"
    )
    merge.add_argument(
        "out_dir", type=Path, help="where to write the merged model (must not exist or be empty)"
    )
    merge.add_argument(
        "--dtype", default=None, help="weights dtype of the output (default: the base model's)"
    )
    args = parser.parse_args(argv)

    if not args.adapter_dir.is_dir():
        parser.error(f"{args.adapter_dir}: no such folder")
    if not is_adapter_folder(args.adapter_dir):
        parser.error(
            f"{args.adapter_dir} is not a LoRA adapter folder (no {ADAPTER_CONFIG_NAME}); a full model folder"
            " needs no merging"
        )
    if args.out_dir.exists() and (not args.out_dir.is_dir() or any(args.out_dir.iterdir())):
        parser.error(f"{args.out_dir} exists and is not an empty folder; choose a new output folder")
    if args.dtype is not None and not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    try:
        out = merge_adapter(args.adapter_dir, args.out_dir, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as error:  # missing base model, broken adapter config
        parser.error(f"cannot merge {args.adapter_dir}: {error}")
    print(f"wrote the merged model to {out}")
    return 0
