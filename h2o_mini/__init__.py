"""h2o-mini: a small, exact, pure-PyTorch reference implementation of H2O KV-cache eviction
(Zhang et al., 2023, arXiv 2306.14048) for OPT, LLaMA (GQA) and GPT-NeoX checkpoints."""
from .api import generate, load, perplexity, stream
from .config import Config
from .errors import UserError
from .policies import (H2O, REGISTRY, TOVA, Full, HeavyHitter, KeyDiff, KNorm, Local, Policy, PyramidKV, Scissorhands,
                       Sinks, SnapKV, make_policy)

__version__ = "0.1.0"

__all__ = ["Config", "UserError", "Policy", "REGISTRY", "make_policy", "Full", "Local", "HeavyHitter", "H2O",
           "Sinks", "TOVA", "Scissorhands", "SnapKV", "PyramidKV", "KNorm", "KeyDiff", "load", "generate", "stream",
           "perplexity"]
