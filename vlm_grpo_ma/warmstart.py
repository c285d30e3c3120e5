"""``python -m vlm_grpo_ma.warmstart``: the supervised warm start of the embedded models (``tools/warmstart.py``)."""

from vlm_grpo_ma.tools.warmstart import main

if __name__ == "__main__":
    main()
