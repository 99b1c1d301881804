"""The backbones the papers use that timm lacks, registered with timm on import (``timm.create_model('lvt')``).

One file per backbone; each declares its swap slots in that file (``models/slots.py``: ``register_slots``),
so the surgery finds them without importing them. ``staged.py`` is the timm interface the pyramid
backbones share.
"""
from . import lvvit  # noqa: F401  (registers lvvit_s, lvvit_m, lvvit_l)
from . import lvt  # noqa: F401  (registers lvt)
from . import cyclemlp  # noqa: F401  (registers cyclemlp_b1 .. b5)
from . import hiremlp  # noqa: F401  (registers hiremlp_tiny .. large)
from . import edgevit  # noqa: F401  (registers edgevit_xxs)
from . import vision_llama  # noqa: F401  (registers pyramid_visionllama_s, _b, _l)

# the timm module names of the backbone files: timm.list_models(module=...) lists what each registers
BACKBONE_MODULES = ('lvvit', 'lvt', 'cyclemlp', 'hiremlp', 'edgevit', 'vision_llama')
