"""Loading a Qwen-VL model: the supported families and the coordinate frame each writes boxes in, the model's
path (``tiny``: the embedded one), the attention implementation, the processor's image bounds, and a LoRA
checkpoint's base model. ``Policy`` is the loaded model with its processor."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlm_grpo_ma.model import linear_attention
from vlm_grpo_ma.task_api.coords import CoordinateFrame
from vlm_grpo_ma.task_api.videos import VideoBudget

SUPPORTED_MODEL_TYPES = {
    # model_type -> the coordinate frame that family was trained to write boxes and points in
    "qwen2_5_vl": CoordinateFrame.ABSOLUTE_INPUT,
    "qwen2_vl": CoordinateFrame.RELATIVE_1000,
    "qwen3_vl": CoordinateFrame.RELATIVE_1000,
    # Qwen3.5 (hybrid: Gated DeltaNet linear attention in 3 of every 4 layers, see model/linear_attention.py)
    # inherits Qwen3-VL's vision stack and grounding format: boxes in 0-1000 of the image
    "qwen3_5": CoordinateFrame.RELATIVE_1000,
    "qwen3_5_moe": CoordinateFrame.RELATIVE_1000,
}




def coordinate_frame_for(model_type: str) -> CoordinateFrame:
    try:
        return SUPPORTED_MODEL_TYPES[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        ) from None


@dataclass
class Policy:
    """A Qwen-VL model and its processor, plus what follows from them (coordinate frame, stop ids)."""

    model: torch.nn.Module
    processor: object
    frame: CoordinateFrame
    # With LoRA: the peft wrapper of ``model`` (its LoRA layers live inside ``model``; see vlm_grpo_ma/model/lora.py)
    adapter: object | None = None
    # How much of each video the model sees (model.video_fps, video_max_frames, video_max_pixels)
    video_budget: VideoBudget = field(default_factory=VideoBudget)

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        ids = {self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        return sorted(i for i in ids if isinstance(i, int) and i >= 0)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]

    @property
    def image_token_id(self) -> int:
        return self.model.config.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.model.config.video_token_id

    @property
    def patch_factor(self) -> int:
        """Pixels per side of one vision token: the patch size times the merge size (28 on Qwen2/2.5-VL)."""
        vision = self.model.config.vision_config
        return vision.patch_size * vision.spatial_merge_size

    @functools.cached_property
    def suppressed_token_ids(self) -> list[int]:
        """Vision placeholder tokens: never sampled (a generated <|image_pad|> would be taken for an image slot
        by the next forward). Their logits are set to -inf both when sampling and when scoring, so sampling
        log-probs and training log-probs stay the same distribution."""
        names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")
        unk = self.tokenizer.unk_token_id
        ids = {self.tokenizer.convert_tokens_to_ids(name) for name in names}
        return sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != unk)


    def stop_candidates(self, stop_text: str) -> frozenset[int]:
        """Token ids whose text holds the stop text's last character. A stop text that was not in a row's
        text before its newest token can only appear now if that token supplies its last character, so
        only after these tokens does decoding need to look (per stop text, computed once)."""
        cache = self.__dict__.setdefault("_stop_candidates", {})
        if stop_text not in cache:
            texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
            cache[stop_text] = frozenset(i for i, text in enumerate(texts) if stop_text[-1] in text)
        return cache[stop_text]


def resolve_model_path(name_or_path: str) -> str:
    from vlm_grpo_ma.model.tiny import TINY_MODEL_DIR, TINY_MODEL_NAME

    return str(TINY_MODEL_DIR) if name_or_path == TINY_MODEL_NAME else name_or_path


def pick_attn_implementation(requested: str) -> str:
    """``auto``: flash_attention_2 where flash-attn is installed and CUDA is present, else sdpa."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def checked_model_path(name_or_path: str, what: str) -> str:
    """``tiny`` -> the embedded folder; an existing model folder as it is (``_check_model_folder``); a hub id
    (``owner/name``) that is in the local Hugging Face cache or that the hub knows. Anything else is a
    FileNotFoundError (a broken folder's config: ValueError) of one line, at once: a mistyped local path
    (``runs/nope``, whose ``runs/`` exists, ``tiny/``, or any path that is no hub id) must not turn into a
    minute of download retries."""
    path = resolve_model_path(name_or_path)
    hint = "give a folder, a hub id like Qwen/Qwen2.5-VL-3B-Instruct, or 'tiny' for the embedded model"
    if Path(path).expanduser().is_dir():
        _check_model_folder(Path(path).expanduser(), f"{what} {name_or_path!r}")
        return str(Path(path).expanduser())
    looks_local = (
        path.startswith(("/", ".", "~")) or path.count("/") != 1 or Path(path.split("/")[0]).is_dir()
        or not _is_hub_id(path)  # `tiny/`: no folder, and the hub refuses the name before any request
    )  # fmt: skip
    if looks_local:
        raise FileNotFoundError(f"{what} {name_or_path!r}: no such local folder ({hint})")
    problem = _hub_problem(path)
    if problem:
        raise FileNotFoundError(f"{what} {name_or_path!r}: no such local folder, and {problem} ({hint})")
    return path


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _check_model_folder(folder: Path, what: str) -> None:
    """FileNotFoundError or ValueError of one line, starting with ``what``, when ``folder`` is no model folder
    that transformers (or peft, with ``adapter_config.json``) loads: its config is missing or no JSON object, its
    model_type no supported family, or it holds no weights or a ``*.safetensors`` whose header does not read. Read
    from file names, the config and the weights' headers only, so a broken folder is refused before anything
    loads, not by transformers in a many-line error."""
    config_file = folder / ("adapter_config.json" if (folder / "adapter_config.json").is_file() else "config.json")
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{what}: {folder} has no config.json, so it is no model folder (a model folder holds config.json and"
            " its weights; a run's models are in its checkpoints/step-*/model)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise ValueError(f"{what}: {config_file} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {config_file} is not a JSON object")
    if config_file.name == "config.json":
        try:
            coordinate_frame_for(config.get("model_type"))
        except ValueError as error:
            raise ValueError(f"{what}: {config_file}: {error}") from None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*model*.bin")):
        raise FileNotFoundError(f"{what}: {folder} holds no weights (no *.safetensors or *model*.bin file)")
    problem = unreadable_weights(folder)  # a weights file cut short (a killed copy or download)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")


def unreadable_weights(folder: Path) -> str | None:
    """What is wrong with the first ``*.safetensors`` file of ``folder`` whose header does not read (naming it),
    or None: read in milliseconds, so a file cut short is refused before the model's load, not in it."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as error:  # noqa: BLE001 - SafetensorError, OSError ...: the file does not load
            return f"{file} does not load ({type(error).__name__}: {error})"
    return None


def _hub_problem(repo_id: str) -> str | None:
    """Why the hub model ``repo_id`` cannot be loaded, asked once with a short timeout (no retries); None when
    it is in the local cache, or the hub has it (transformers then downloads it)."""
    import huggingface_hub
    from huggingface_hub.utils import HfHubHTTPError, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "it is not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
    try:
        huggingface_hub.model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        return "the Hugging Face hub has no model of that id (or it is private: log in with `hf auth login`)"
    except HfHubHTTPError:
        return None  # gated, rate-limited ...: from_pretrained says what it needs
    except Exception as error:  # noqa: BLE001 - no network: DNS, connection and timeout errors of any client
        return f"it is not in the Hugging Face cache and the hub cannot be reached ({type(error).__name__})"
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: a tokenizer transformers reads


def _load_processor(auto_processor, path: str):
    """The processor of a model folder or hub id; ValueError of one line naming the folder when it has no
    tokenizer file (transformers then asks for sentencepiece in a long message) or the processor fails."""
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): copy the model's tokenizer files into it")
    try:
        return auto_processor.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: the processor does not load ({type(error).__name__}: {first})") from error


def load_policy(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    device: torch.device | str = "cpu",
    video_budget: VideoBudget | None = None,
) -> Policy:
    """Load a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 (dense or MoE) model (hub id or local path; ``tiny`` = the
    embedded one). On Qwen3.5 the Gated DeltaNet layers get ``linear_attention.install``'s forward.

    A folder with ``adapter_config.json`` (a LoRA checkpoint) loads the base model it names in
    ``base_model_name_or_path``, then the adapter, trainable (resume continues training it): ``policy.model``
    is the base model with the LoRA layers inside, ``policy.adapter`` the peft wrapper.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    path = checked_model_path(name_or_path, "model.name_or_path")
    processor_path, adapter_dir = path, None
    if (Path(path) / "adapter_config.json").is_file():
        adapter_dir = Path(path)
        base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{adapter_dir / 'adapter_config.json'} names no base_model_name_or_path")
        path = checked_model_path(base, f"base model of the LoRA adapter {adapter_dir}:")
        if (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"the base model of {adapter_dir} is itself an adapter ({path}); merge it first")
        # a checkpoint saves the processor next to the adapter; a bare adapter folder uses the base's
        if any((adapter_dir / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
            processor_path = str(adapter_dir)
        else:
            processor_path = path
    config = AutoConfig.from_pretrained(path)
    frame = coordinate_frame_for(config.model_type)
    processor = _load_processor(AutoProcessor, processor_path)
    if min_pixels is not None or max_pixels is not None:
        # the image processor's resize bounds (in pixels) live in size = {shortest_edge, longest_edge}
        size = dict(processor.image_processor.size)
        size["shortest_edge"] = min_pixels if min_pixels is not None else size["shortest_edge"]
        size["longest_edge"] = max_pixels if max_pixels is not None else size["longest_edge"]
        processor.image_processor.size = size
    processor.tokenizer.padding_side = "left"
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is not None and hasattr(video_processor, "cap_pixels_per_frame"):
        # frames arrive sized by the run's video budget (task_api/videos.py) and are not resized again, so
        # transformers' per-frame pixel cap (which warns when left unset) has nothing to cap
        video_processor.cap_pixels_per_frame = False
    # use_kernels=False: with the `kernels` package installed (transformers >= 5.25 requires it), a model loaded
    # with the default swaps layers for Hub kernels at its first .train() on CUDA, fetching them from the Hub
    # (an offline GPU run stops there) and changing the numerics the trainer's one log-prob path is held to.
    model = AutoModelForImageTextToText.from_pretrained(
        path,
        dtype=getattr(torch, dtype),
        attn_implementation=pick_attn_implementation(attn_implementation),
        use_kernels=False,
    ).to(device)
    if linear_attention.is_hybrid(model.config):
        linear_attention.install(model)  # pads as no-ops, states that branch and carry gradients
    adapter = None
    if adapter_dir is not None:
        from peft import PeftModel

        # LoRA layers are injected into `model` in place; base weights stay frozen, the adapter trains
        adapter = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    return Policy(model=model, processor=processor, frame=frame, adapter=adapter, video_budget=video_budget or VideoBudget())


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
