"""Rollout engines: what samples a step's K x M tree (``rollout.engine``), and the ``Rollout`` they return
(``rollout.py``). This layer imports the model and the task layers below it, never the run: the run picks and
builds the engine from its config (``run/rollout_engine.py``).

Every engine returns the same ``Rollout`` (ids, sampling log-probs, thought/answer structure), so rewards,
advantages, the batch and the update do not know which one sampled. ``hf`` (``hf.py``) is the KV-branching
decode loop of ``decode.sample_tree``; ``vllm`` (``vllm.py``) an in-process vLLM engine that samples the tree
through its prefix cache and gets the policy's weights after every update.

An engine has three calls: ``sample(policy, samples, prompts, num_thoughts=, num_answers=, settings=)`` ->
Rollout; ``push_weights(policy)`` after each update; ``step_metrics()`` -> figures of the last step.
"""

from __future__ import annotations

ENGINES = ("hf", "vllm")
