"""Tokenizers of the VLA's language input: instruction and discretised state -> token ids.

Input: one instruction string and the state's bins (``rlvla3.policies.vla.normalize``). Output: the
instruction's token ids (not padded) and the state's separate token ids (none when the state
is part of the text).

Strategies, chosen by ``VLAConfig.tokenizer``:

- ``ByteTokenizer`` (checkpoints trained here): ``BOS`` then the UTF-8 bytes of the
  lower-cased, space-normalised instruction; state bin ``b`` is the separate token
  ``256 + b``. Vocabulary: bytes 0-255, state bins 256-511, ``BOS`` 512, ``PAD`` 513.
- ``PaliGemmaTokenizer`` (pi0.5): a SentencePiece model (PaliGemma's
  ``paligemma_tokenizer.model``, given as a local path) encodes the pi0.5 prompt
  ``"Task: {instruction}, State: {b1 b2 ...};\\nAction: "`` after ``BOS`` (LeRobot's pi05 and
  openpi's ``discrete_state_input``), or, without state, ``BOS + encode(instruction) +
  encode("\\n")`` (openpi's state-free format, used by its ``pi05_libero``). The instruction is
  cleaned as both do: stripped, ``_`` and newlines turned into spaces. Truncated to
  ``max_tokens`` (200 for pi0.5) from the right, as the reference truncates.

``sentencepiece`` is imported when a ``PaliGemmaTokenizer`` is built, never before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

STATE_OFFSET = 256
BOS = 512
PAD = 513


def tokenize(text: str, max_tokens: int) -> list[int]:
    """Normalise (lower case, single spaces) and byte-encode; ``BOS`` first; truncated."""
    norm = " ".join(text.lower().split())
    return [BOS, *norm.encode("utf-8")][:max_tokens]


class ByteTokenizer:
    """The built-in byte tokenizer, the state as separate bin tokens."""

    pad_id = PAD

    def __init__(self, max_tokens: int, state_dim: int, bins: int):
        self.max_tokens, self.state_tokens, self.bins = max_tokens, state_dim, bins

    @property
    def vocab_size(self) -> int:
        return PAD + 1

    def encode(self, instruction: str, state_bins: np.ndarray) -> tuple[list[int], list[int]]:
        state = np.clip(state_bins, 0, self.bins - 1) + STATE_OFFSET
        return tokenize(instruction, self.max_tokens), state.tolist()


def clean_instruction(text: str) -> str:
    """The reference's cleaning: stripped, ``_`` and newlines replaced by spaces."""
    return text.strip().replace("_", " ").replace("\n", " ")


def pi05_prompt(instruction: str, state_bins: np.ndarray | None) -> str:
    """The pi0.5 prompt with the discretised state (``None``: the state-free text)."""
    text = clean_instruction(instruction)
    if state_bins is None:
        return text + "\n"
    state = " ".join(str(int(b)) for b in state_bins)
    return f"Task: {text}, State: {state};\nAction: "


class PaliGemmaTokenizer:
    """PaliGemma's SentencePiece model on the pi0.5 prompt; no separate state tokens."""

    state_tokens = 0

    def __init__(self, path: str | Path, max_tokens: int, with_state: bool):
        try:
            import sentencepiece
        except ImportError as exc:  # a declared dependency; a broken install names it
            raise ImportError("the pi0.5 tokenizer needs the Python package 'sentencepiece' "
                              "(pip install sentencepiece)") from exc
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no SentencePiece model at {path} (PaliGemma's "
                                    "paligemma_tokenizer.model; nothing is downloaded)")
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as exc:
            raise ValueError(f"{path} is not a SentencePiece model: {exc}") from None
        if self.sp.bos_id() < 0:
            raise ValueError(f"the SentencePiece model {path} has no BOS piece")
        self.path, self.max_tokens, self.with_state = path, max_tokens, with_state
        self.pad_id = max(self.sp.pad_id(), 0)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def prompt(self, instruction: str, state_bins: np.ndarray) -> str:
        return pi05_prompt(instruction, state_bins if self.with_state else None)

    def encode(self, instruction: str, state_bins: np.ndarray) -> tuple[list[int], list[int]]:
        if self.with_state:
            ids = self.sp.encode(self.prompt(instruction, state_bins))
        else:  # openpi encodes the newline on its own ("start of answer")
            ids = self.sp.encode(clean_instruction(instruction)) + self.sp.encode("\n")
        return [self.sp.bos_id(), *ids][: self.max_tokens], []


Tokenizer = ByteTokenizer | PaliGemmaTokenizer
