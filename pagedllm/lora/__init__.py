"""Multi-LoRA serving (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023): many PEFT adapters on
one base model, mixed in one batch (``layers.py``: one grouped low-rank pass per target module)."""
