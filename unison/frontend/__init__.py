"""Frontend: per-request Python work (tokenizing, chat templates, detokenizing, stop strings).

Nothing here imports torch or transformers: a frontend must start in well under a second.
"""

from unison.frontend.text.detokenizer import IncrementalDetokenizer
from unison.frontend.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
