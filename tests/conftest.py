import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def untrained_tiny_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2.5-VL saved to disk (built in about a second, no download)."""
    from vlm_grpo_ma.tiny import build_untrained

    return build_untrained(tmp_path_factory.mktemp("tiny-init"), seed=0)


@pytest.fixture(scope="session")
def tiny_policy(untrained_tiny_dir):
    from vlm_grpo_ma.policy import load_policy

    policy = load_policy(str(untrained_tiny_dir), attn_implementation="sdpa")
    policy.model.eval()
    return policy
