"""The prompt source: prompts from JSONL or Parquet files, or a generator, each with a stable id.

Its position is a single integer, the cursor: prompt ``p`` is item ``perm(epoch)[p % N]`` of epoch
``p // N``, where ``perm(epoch)`` is a permutation seeded by ``(shuffle_seed, epoch)``. So
``take(cursor, n)`` is a pure function of the cursor: idempotent, safe to re-run after any
crash, and the position to checkpoint is just ``(cursor, shuffle_seed)``, which the learner's
checkpoint carries. A prompt's id is ``<item id>@<epoch>``: the same item in two epochs gives two
distinct samples, so a ledger never mistakes the second for a duplicate.

Rows are mappings with ``prompt`` (text), ``answer`` (what the verifier checks) and optionally
``id`` (defaults to the row number).
"""

from __future__ import annotations

import importlib
import json
import random
from array import array
from collections.abc import Mapping
from typing import Any

import msgspec

from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.payloads import Prompt, Sample

__all__ = ["TOKEN_CACHE_BYTES", "PromptSource", "Take", "load_rows"]

TOKEN_CACHE_BYTES = 64 << 20
"""The most memory the source spends keeping prompts' token ids (4 bytes a token, and each
row's array and its entry). Encoding a prompt costs about 20 µs, and a run whose prompt schedule
skips most prompts asks for the same rows epoch after epoch (millions of prompts in the
README's main job with the schedule on); past this, rows are encoded each time they are
served."""

_ROW_BYTES = 144
"""What a kept row costs besides its ids: its array's header (80 bytes) and its dict entry."""


def _kept_bytes(tokens: int) -> int:
    """What keeping a row of ``tokens`` token ids costs against ``TOKEN_CACHE_BYTES``."""
    return 4 * tokens + _ROW_BYTES


class Take(msgspec.Struct):
    """Ask for ``n`` prompts starting at ``cursor``."""

    cursor: int
    n: int


def load_rows(
    path: str = "", generator: str = "", options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Rows from a ``.jsonl`` or ``.parquet`` file, or from ``module:function(**options)``.

    Raises:
        ValueError: neither or both sources given, an unknown file type, or a row without
            ``prompt``.
    """
    if bool(path) == bool(generator):
        raise ValueError("prompt source: give exactly one of 'path' and 'generator'")
    rows: list[dict[str, Any]]
    if generator:
        module, _, name = generator.partition(":")
        fn = getattr(importlib.import_module(module), name or "rows")
        rows = list(fn(**(options or {})))
    elif path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # optional: only Parquet sources need it
        except ImportError as exc:
            raise ValueError(
                f"prompt source: reading {path} needs pyarrow; pip install pyarrow"
            ) from exc
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"prompt source: {path!r} is neither .jsonl nor .parquet")
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise ValueError(f"prompt source: row {i} of {path or generator} has no 'prompt'")
        row.setdefault("id", str(i))
        row.setdefault("answer", "")
    return rows


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class PromptSource(Role):
    """Serves prompts by cursor, tokenized with the run's tokenizer."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The prompt source's settings (``roles.<name>.config`` in the manifest).

        Attributes:
            path: a ``.jsonl`` or ``.parquet`` file of rows with ``prompt``, ``answer`` and
                optionally ``id`` (the row number when missing); give exactly one of
                ``path`` and ``generator``.
            generator: or ``module:function``, called with ``options`` as keywords, that
                returns the rows (``module`` alone calls its ``rows``).
            options: the generator's keyword arguments.
            tokenizer_path: the tokenizer that encodes each prompt's text into its token ids
                (the policy's); the manifest's ``model.tokenizer`` when not set. Needed for
                ``demonstrations``; without one prompts carry no token ids. Each row is
                encoded once and kept (up to ``TOKEN_CACHE_BYTES``, 64 MiB).
            shuffle_seed: seeds each epoch's permutation of the rows (``take`` is a pure
                function of the cursor and this seed).
        """

        path: str = ""
        generator: str = ""
        options: dict[str, Any] = {}
        tokenizer_path: str = ""
        shuffle_seed: int = 0

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        if config.get("tokenizer_path"):
            from transformers import AutoTokenizer  # noqa: F401

    async def setup(self) -> None:
        # In the worker thread: loading the data and importing transformers take seconds, and
        # the loop must keep answering heartbeats meanwhile.
        self.rows = await self.ctx.offload(
            load_rows, self.config.path, self.config.generator, self.config.options
        )
        if not self.rows:
            raise ValueError("prompt source: the dataset is empty")
        path = self.config.tokenizer_path
        self.tokenizer = await self.ctx.offload(_tokenizer, path) if path else None
        self._perms: dict[int, list[int]] = {}
        self._token_ids: dict[int, array[int]] = {}  # row -> its prompt's token ids
        self._cached_bytes = 0

    def _perm(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(len(self.rows)))
            random.Random(f"{self.config.shuffle_seed}:{epoch}").shuffle(perm)
            self._perms = {epoch: perm}  # only the current epoch is ever needed again
        return perm

    @endpoint(Delivery.IDEMPOTENT)
    async def take(self, request: Take) -> list[Prompt]:
        if request.cursor < 0 or request.n < 0:
            raise ValueError(f"take needs cursor >= 0 and n >= 0, got {request}")
        size = len(self.rows)
        out = []
        for p in range(request.cursor, request.cursor + request.n):
            epoch, index = divmod(p, size)
            row_index = self._perm(epoch)[index]
            row = self.rows[row_index]
            out.append(
                Prompt(
                    id=f"{row['id']}@{epoch}",
                    token_ids=self._encode(row_index),
                    text=row["prompt"],
                    answer=str(row["answer"]),
                )
            )
        return out

    def _encode(self, row_index: int) -> list[int]:
        """The token ids of a row's prompt, kept once encoded while ``TOKEN_CACHE_BYTES``
        allows."""
        if self.tokenizer is None:
            return []
        cached = self._token_ids.get(row_index)
        if cached is not None:
            return cached.tolist()
        ids: list[int] = self.tokenizer.encode(self.rows[row_index]["prompt"])
        cost = _kept_bytes(len(ids))
        if self._cached_bytes + cost <= TOKEN_CACHE_BYTES:  # past it, nothing is copied
            self._token_ids[row_index] = array("I", ids)
            self._cached_bytes += cost
        return ids

    @endpoint(Delivery.IDEMPOTENT)
    async def demonstrations(self, request: Take) -> list[Sample]:
        """The same prompts as ``take``, each with its answer as the completion (and the
        tokenizer's end-of-sequence token): demonstrations for behaviour cloning."""
        if self.tokenizer is None:
            raise ValueError("demonstrations need tokenizer_path in the prompt source config")
        eos = self.tokenizer.eos_token_id
        out = []
        for prompt in await self.take(request):
            answer = list(self.tokenizer.encode(prompt.answer, add_special_tokens=False))
            tokens = [*answer, eos] if eos is not None else answer
            out.append(
                Sample(
                    prompt_id=prompt.id,
                    sample_index=0,
                    prompt_ids=prompt.token_ids,
                    token_ids=tokens,
                    logprobs=[],
                    versions=[],
                    finished=True,
                    stop_reason="stop",
                )
            )
        return out

    @endpoint(Delivery.IDEMPOTENT)
    async def size(self, _: Any) -> int:
        return len(self.rows)
