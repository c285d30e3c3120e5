import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    # Tests that start an in-process vLLM engine run last: the engine binds threads (torch.set_num_threads becomes
    # a no-op) and starts a process group for the rest of the process.
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)  # stable: the order is otherwise kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def untrained_tiny_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2.5-VL saved to disk (built in about a second, no download)."""
    from vlm_grpo_ma.model.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("tiny-init"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen3.5 (hybrid linear attention) saved to disk (tests/tiny_families.py)."""
    from tiny_families import save_tiny

    return save_tiny("qwen3_5", tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture
def fresh_registry(monkeypatch):
    """The task registry as a process starts it, but with the built-in modules already imported (a second import
    is a no-op, as in a real process that imported one before the first lookup); what a test registers is
    forgotten after it."""
    from vlm_grpo_ma.task_api import registry

    registry.load_builtin_tasks()
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))
    monkeypatch.setattr(registry, "_SOURCES", dict(registry._SOURCES))
    monkeypatch.setattr(registry, "_builtins_loaded", False)
    monkeypatch.setattr(registry, "_IMPORTED_MODULES", list(registry._IMPORTED_MODULES))


@pytest.fixture(scope="session")
def tiny_policy(untrained_tiny_dir):
    from vlm_grpo_ma.model.loading import load_policy

    policy = load_policy(str(untrained_tiny_dir), attn_implementation="sdpa")
    policy.model.eval()
    return policy


# A few steps of the tiny model as the end-to-end tests run them: 2 prompts x 2 thoughts x 2 answers, short
# texts, micro-batches of 3 rows (so a prompt's tree is split), no evaluation, no progress bar or TensorBoard.
TINY_RUN = (
    "train.prompts_per_step=2",
    "train.micro_batch_rows=3",
    "rollout.num_thoughts=2",
    "rollout.num_answers=2",
    "rollout.max_thought_tokens=8",
    "rollout.max_answer_tokens=6",
    "logging.progress_bar=false",
    "logging.report_to=[]",
    "train.eval_every=0",
)


def tiny_run_config(model_dir, out_dir, *extra, steps: int = 4):
    """The config of a tiny end-to-end run of ``steps`` steps in ``out_dir`` (``extra``: more overrides)."""
    from vlm_grpo_ma.run.config_files import load_config

    return load_config(
        None, [f"model.name_or_path={model_dir}", f"train.output_dir={out_dir}", f"train.steps={steps}", *TINY_RUN, *extra]
    )
