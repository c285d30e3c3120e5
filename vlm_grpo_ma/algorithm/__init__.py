"""The objective, as pure functions of tensors: advantage estimators (``advantages.py``), policy losses and
their aggregation over tokens, sequences and the step (``loss.py``), and GRPO-MA's diagnostics
(``diagnostics.py``). Imports torch and nothing else of the package: no model, no run, no I/O."""
