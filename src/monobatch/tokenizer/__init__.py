"""Tokenization for every door: text <-> ids, chat templates, streaming detokenization.

Shared by the server, the CLI and the Python API; the engine itself only sees token ids.
"""

from monobatch.tokenizer.chat_template import ChatTemplate, load_chat_template, normalize_messages
from monobatch.tokenizer.detokenizer import IncrementalDetokenizer
from monobatch.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer", "load_chat_template", "normalize_messages"]
