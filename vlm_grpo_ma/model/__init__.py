"""The only code that knows Qwen-VL. Loading a model and its processor (``loading.py``), a sample's prompt and
images as the model's inputs (``prompts.py``), the KV cache (``cache.py``), token log-probs, the one path of
every trained, old and reference log-prob (``logprobs.py``), LoRA (``lora.py``), the published architectures
and their parameter counts (``architectures.py``), and the embedded tiny model's builder (``tiny.py``).

May import ``algorithm`` and ``task_api``; never the engines, the run or the tools."""
