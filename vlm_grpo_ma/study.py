"""``python -m vlm_grpo_ma.study``: GRPO-MA's claims measured over a grid of settings and seeds (``tools/study.py``)."""

import sys

from vlm_grpo_ma.tools.study import main

if __name__ == "__main__":
    sys.exit(main())
