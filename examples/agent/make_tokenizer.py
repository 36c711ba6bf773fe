"""Writes the word-level tokenizer of the agent example into ``tokenizer/``.

Run once; the files are shipped, and everything else loads them with the transformers API
(``AutoTokenizer.from_pretrained("examples/agent/tokenizer")``).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from examples.agent.game import HIGH

SPECIAL = ["<pad>", "<eos>"]
WORDS = ["guess", "to", "higher", "lower", "correct", "invalid", *map(str, range(1, HIGH + 1))]


def build() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer")
    build().save_pretrained(out)
    print(f"wrote {out}")
