"""Rollout engines: what samples a step's K x M tree (``rollout.engine``), and the ``Rollout`` they return
(``rollout.py``). This layer imports the model and the task layers below it, never the run: the run picks and
builds the engine from its config (``run/rollout_engine.py``).

Every engine returns the same ``Rollout`` (ids, sampling log-probs, thought/answer structure), so rewards,
advantages, the batch and the update do not know which one sampled. ``hf`` (``hf.py``) is the KV-branching
decode loop of ``decode.sample_tree``; ``vllm`` (``vllm.py``) an in-process vLLM engine that samples the tree
through its prefix cache and gets the policy's weights after every update.

An engine has five calls: ``sample(policy, samples, prompts, num_thoughts=, num_answers=, settings=)`` ->
Rollout of those prompts; ``sleep_until_push()`` once the step's sampling is done, before the update;
``push_weights(policy)`` after each update, on every process; ``step_metrics()`` -> figures of the last step;
``close(orderly)`` at the run's end. And four facts the run reads: ``samples_with_policy`` (the trainer's
model decodes: gather FSDP units and autocast around ``sample``), ``processes_per_engine`` (a group of that
many consecutive processes shares one engine and sends it the group's prompts; each keeps its own share),
``metrics_prefix`` (where one process's figures go in a launch, or None) and ``name``.
"""

from __future__ import annotations

ENGINES = ("hf", "vllm")
