"""The benchmark's data: a corpus that ships with Python, and the batches every method sees alike."""
from __future__ import annotations

import torch


#: ``--corpus stdlib``: the Python standard library's own sources
STDLIB = "stdlib"


def load_corpus(path: str | None = None) -> bytes:
    """The training text: ``path``'s bytes; ``"stdlib"``, the ``.py`` files of the running Python's
    standard library (tests and site-packages left out) in sorted path order, joined by newlines
    (12.6 MB on Python 3.11: long runs that do not repeat it); else Python's own help texts
    (``pydoc_data.topics``, 466 kB: one pass in 240 steps of 4 x 8 x 64 bytes)."""
    if path == STDLIB:
        import pathlib
        import sysconfig

        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py")
                       if not {"site-packages", "test", "tests"} & set(p.parts))
        return b"\n".join(p.read_bytes() for p in files)
    if path:
        with open(path, "rb") as f:
            return f.read()
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class Batches:
    """Global batches drawn by step number: every method and rank draws the same sequences;
    rank ``r`` takes rows ``[r*b, (r+1)*b)``. The last 5% of the corpus is held out."""

    def __init__(self, corpus: bytes, seq_len: int, batch: int, rank: int, world: int, seed: int):
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        split = int(len(data) * 0.95)
        self.train, self.val = data[:split], data[split:]
        if len(self.val) < seq_len + 2 or len(self.train) < seq_len + 2:
            raise ValueError(f"the corpus ({len(data)} bytes) is too short for --seq-len {seq_len}")
        self.seq_len, self.batch, self.rank, self.world, self.seed = seq_len, batch, rank, world, seed

    def _rows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        seqs = data[idx]
        return seqs[:, :-1], seqs[:, 1:]

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch * self.world,), generator=g)
        mine = starts[self.rank * self.batch:(self.rank + 1) * self.batch]
        return self._rows(self.train, mine)

    def val_batches(self, sequences: int, per_batch: int):
        """This rank's share of ``sequences`` fixed held-out sequences, in batches."""
        g = torch.Generator().manual_seed(self.seed + 7)
        starts = torch.randint(0, len(self.val) - self.seq_len - 1, (sequences,), generator=g)
        mine = starts[self.rank::self.world]
        for i in range(0, len(mine), per_batch):
            yield self._rows(self.val, mine[i:i + per_batch])

