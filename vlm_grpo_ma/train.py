"""``python -m vlm_grpo_ma.train``: train: GRPO-MA on a task or a mixture (the run: ``vlm_grpo_ma/run``; arguments: ``run/cli.py``)."""

import sys

from vlm_grpo_ma.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
