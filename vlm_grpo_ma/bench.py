"""``python -m vlm_grpo_ma.bench``: benchmarks of the rollout, the training forward and the engines (``tools/bench.py``)."""

from vlm_grpo_ma.tools.bench import main

if __name__ == "__main__":
    main()
