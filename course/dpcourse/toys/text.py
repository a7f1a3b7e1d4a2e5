"""A small character-level text, generated from a seed (no download), and its tokenizer.

Used by notebook 13 (the GPT it trains in data x pipeline x tensor parallel), its hidden checks and its
benchmark.

    text = arithmetic_text(20_000, seed=0)     # "37 + 45 = 82.\n91 - 8 = 83.\n..."
    ids = encode(text)                         # a LongTensor of character ids, VOCAB = 16 of them
    samples = windows(ids, seq=128)            # (n, seq + 1): inputs [:, :-1], next characters [:, 1:]

Why arithmetic: a language model learns something visible in a few hundred steps (the layout of a line
first, then which digits follow which), the alphabet is 16 characters (a vocabulary that splits evenly
over 1, 2, 4 or 8 tensor-parallel ranks), and any seed gives another text of the same kind.
"""

import torch

ALPHABET = "0123456789 +-=.\n"
VOCAB = len(ALPHABET)
_INDEX = {c: i for i, c in enumerate(ALPHABET)}


def arithmetic_text(n_chars, seed=0):
    """About n_chars characters of lines "a + b = c." and "a - b = c." with a, b < 100 (c >= 0)."""
    g = torch.Generator().manual_seed(seed)
    lines, length = [], 0
    while length < n_chars:
        a, b = (int(v) for v in torch.randint(0, 100, (2,), generator=g))
        if torch.rand((), generator=g) < 0.5:
            line = f"{a} + {b} = {a + b}.\n"
        else:
            a, b = max(a, b), min(a, b)
            line = f"{a} - {b} = {a - b}.\n"
        lines.append(line)
        length += len(line)
    return "".join(lines)[:n_chars]


def encode(text):
    """Character ids of `text` (a LongTensor); a character outside ALPHABET raises a ValueError."""
    unknown = sorted(set(text) - set(ALPHABET))
    if unknown:
        raise ValueError(f"characters outside the alphabet {ALPHABET!r}: {unknown}")
    return torch.tensor([_INDEX[c] for c in text], dtype=torch.long)


def decode(ids):
    return "".join(ALPHABET[int(i)] for i in ids)


def windows(ids, seq):
    """Non-overlapping samples of seq + 1 characters, shape (len(ids) // seq - 1, seq + 1): sample i is
    ids[i*seq : i*seq + seq + 1], so its inputs are [:seq] and its targets (the next characters) [1:]."""
    n = (len(ids) - 1) // seq
    if n < 1:
        raise ValueError(f"{len(ids)} characters make no sample of {seq + 1}")
    return torch.stack([ids[i * seq:i * seq + seq + 1] for i in range(n)])


def samples(n_samples, seq, seed=0):
    """n_samples windows of a text generated for them: shape (n_samples, seq + 1)."""
    return windows(encode(arithmetic_text(n_samples * seq + 1, seed)), seq)[:n_samples]
