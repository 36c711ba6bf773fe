"""Writes the character-level tokenizer of the reasoning-gym example into ``tokenizer/``: every
printable ASCII character, one token each, plus padding and end of sequence.

Run once; the files are shipped, and loaded with
``AutoTokenizer.from_pretrained("examples/reasoning_gym/tokenizer")``.
"""

from __future__ import annotations

import os
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>"]
CHARS = [c for c in string.printable if c.isprintable()]


def build() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer")
    build().save_pretrained(out)
    print(f"wrote {out}")
