"""The exact shared-prefix engine on PyTorch: cascade attention over a group's prefix KV and each
member's suffix (`cascade_attention.py`), option rows (`options.py`), hybrid prefilling
(`hybrid.py`), compiled decoder layers (`compiled_layers.py`), the KV memory estimate
(`memory.py`); `engine.py` drives them pass by pass. A face only: it imports nothing."""
