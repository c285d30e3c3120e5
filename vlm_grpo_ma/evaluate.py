"""``python -m vlm_grpo_ma.evaluate``: score models side by side on held-out splits or benchmark files (``tools/evaluate.py``)."""

import sys

from vlm_grpo_ma.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
