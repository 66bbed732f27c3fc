"""Frontend: per-request Python work (tokenizing, chat templates, detokenizing, stop strings).

Nothing here imports torch or transformers: a frontend must start in well under a second.
"""

from unison.frontend.detokenizer import IncrementalDetokenizer
from unison.frontend.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
