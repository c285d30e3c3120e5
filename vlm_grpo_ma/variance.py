"""``python -m vlm_grpo_ma.variance``: the thought advantage's variance against M, by redrawing answers (``tools/variance.py``)."""

import sys

from vlm_grpo_ma.tools.variance import main

if __name__ == "__main__":
    sys.exit(main())
