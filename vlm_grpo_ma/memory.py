"""``python -m vlm_grpo_ma.memory``: the memory model of a preset, per GPU (``tools/memory.py``)."""

from vlm_grpo_ma.tools.memory import main

if __name__ == "__main__":
    raise SystemExit(main())
