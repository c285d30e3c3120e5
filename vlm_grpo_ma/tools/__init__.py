"""Programs around the trainer, each behind a ``python -m vlm_grpo_ma.<name>`` command: ``evaluate.py``,
``study.py`` (with ``study_runs.py`` and ``study_report.py``), ``variance.py``, ``bench.py`` (with
``bench_inputs.py`` and ``bench_engines.py``), ``memory.py`` (the memory model of a preset) and
``warmstart.py``. May import every layer below: ``algorithm``, ``task_api``, ``model``, ``engines``, ``run``."""
