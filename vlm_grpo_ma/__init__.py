"""vlm-grpo-ma: GRPO-MA reinforcement learning for Qwen-VL vision-language models.

The package is built in layers; a module imports only from its own sub-package (without a circle) and from
the layers below it (``tests/test_layers.py`` reads every import, the lazy ones included):

1. ``algorithm/``  the objective as pure functions of tensors: advantages, losses and their aggregation,
                   GRPO-MA's diagnostics. Imports nothing else of the package.
2. ``task_api/``   what a task is and what runs it: the public API for task authors (``vlm_grpo_ma.task_api``),
                   the registry, parsers, data readers, coordinate frames, images, reward workers, prompt streams.
3. ``model/``      the only code that knows Qwen-VL: loading, prompts and images, the KV cache, token
                   log-probs (the one log-prob path), LoRA, published architectures, the embedded tiny model.
4. ``engines/``    what samples a step's K x M tree (the HF decode loop, vLLM) and the ``Rollout`` it returns.
5. ``run/``        a training run: its config (which imports no other run module), setup, the loop, rewards
                   of a rollout, the batch and the update, processes and sharding, checkpoints, the run
                   folder, metrics, trackers, evaluation during training.
6. ``tools/``      programs around the trainer: evaluate, study, variance, bench, memory, warm start.
7. the commands    ``python -m vlm_grpo_ma.<name>`` for train, evaluate, study, bench, memory, lora,
                   warmstart, variance: each is a few lines that call its layer's ``main``.
"""
