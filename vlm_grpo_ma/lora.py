"""``python -m vlm_grpo_ma.lora``: merge a LoRA checkpoint into its base model (``model/lora.py``)."""

import sys

from vlm_grpo_ma.model.lora import main

if __name__ == "__main__":
    sys.exit(main())
