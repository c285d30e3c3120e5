"""Task families: one module per family; each registers itself with ``vlm_grpo_ma.task_api.registry`` on import."""
