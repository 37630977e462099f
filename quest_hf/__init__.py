"""quest-hf: Quest query-aware sparse decode attention (arXiv 2406.10774) for Hugging Face transformers.

    from quest_hf import patch_model
    patch_model(model, budget=2048, page_size=16)
    model.generate(...)
"""
from . import versions  # noqa: F401 - first: refuses an unsupported transformers before its classes are used
from .cache import QuestCache, QuestLayer
from .calibration import calibrate
from .chunked_prefill import prefill
from .config import QuestConfig
from .patch import patch_model, patched, release_cache, unpatch_model
from .plan import LayerPlan, describe_patch, layer_plan

__all__ = ["patch_model", "calibrate", "unpatch_model", "patched", "release_cache", "describe_patch", "layer_plan",
           "LayerPlan", "QuestConfig", "QuestCache", "QuestLayer", "prefill"]
__version__ = "0.1.0"
