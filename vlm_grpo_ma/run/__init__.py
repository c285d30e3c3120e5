"""A training run. ``config.py`` (the typed config; it imports no other run module), ``setup.py`` (processes,
run folder, data, model, optimizer, resumed state -> ``RunState``), ``loop.py`` (``train``: one step after
another), ``cli.py`` (arguments and exit codes); per step: ``rollout_engine.py`` (which engine samples),
``rewards.py`` (a rollout's rewards), ``dynamic_sampling.py``, ``batch.py`` (rows and per-token advantages),
``update.py`` (the one scoring path and the optimiser step), ``step_metrics.py``; around it:
``distributed.py``, ``sharding.py`` (FSDP2), ``survive.py`` (stopping together), ``checkpoint.py``,
``run_dir.py``, ``metrics.py``, ``trackers.py``, ``evaluation.py`` and ``held_out.py`` (scoring held-out samples).

May import every layer below it: ``algorithm``, ``task_api``, ``model``, ``engines``; never the tools."""
