"""h2o-mini: a small, exact, pure-PyTorch reference implementation of H2O KV-cache eviction
(Zhang et al., 2023, arXiv 2306.14048) for OPT, LLaMA (GQA), GPT-NeoX, Qwen2, Qwen3, Mistral,
Phi-3 and Gemma 2 / Gemma 3 checkpoints."""
from .api import generate, load, stream
from .config import Config
from .errors import UserError
from .evals.ppl import perplexities, perplexity
from .views.record import Recording, record
from .policies import (A2SF, H2O, REGISTRY, RKV, TOVA, VATP, Full, HeavyHitter, KeyDiff, KNorm, Local, PagedH2O, Policy,
                       PyramidKV, Scissorhands, Sinks, SnapKV, make_policy, param)

__version__ = "0.1.0"

__all__ = ["Config", "UserError", "Policy", "param", "REGISTRY", "make_policy", "Full", "Local", "HeavyHitter", "H2O",
           "Sinks", "TOVA", "Scissorhands", "SnapKV", "PyramidKV", "KNorm", "KeyDiff", "A2SF", "VATP", "PagedH2O", "RKV",
           "load", "generate", "stream", "perplexity", "perplexities", "record", "Recording"]
