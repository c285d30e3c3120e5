"""vlm-grpo-ma: GRPO-MA reinforcement learning for Qwen-VL vision-language models."""
