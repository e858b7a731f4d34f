"""The table speculators' `ArrowDataset` reads beside the `hs_{i}` files: a `datasets` table saved with
`save_to_disk`, in torch format, one row per file in file order (row i is read with `hidden_states/hs_{i}`):
`input_ids` (int32 lists), `loss_mask` (int64 lists) and `seq_len` (int64), the columns and types speculators'
own data preparation writes. speculators takes the loss mask from here and checks the file's token ids against
`input_ids`. Also `token_freq.pt`: the count of every supervised token id, which its vocabulary mapping reads
(`--draft-vocab-size`).

Rows are streamed to an Arrow file as the export writes its files, so that no more than a batch of rows is held,
then saved with `datasets` (which speculators' users have: it is one of its requirements).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from dflash_queue.storage.base import Storage

TOKEN_FREQ = "token_freq.pt"
_BATCH_ROWS = 256


class SpeculatorsTable:
    def __init__(self) -> None:
        try:
            import datasets  # noqa: F401
            import pyarrow as pa
        except ImportError as exc:
            raise ImportError(
                f"export --format speculators writes speculators' datasets table and needs the `datasets` package "
                f"({exc}): pip install datasets"
            ) from None
        self._pa = pa
        self._dir = tempfile.TemporaryDirectory(prefix="dfq-speculators-table-")
        self._arrow = Path(self._dir.name) / "rows.arrow"
        self._schema = pa.schema(
            [("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())]
        )
        self._writer = pa.ipc.new_stream(str(self._arrow), self._schema)
        self._rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        self.token_freq: Counter[int] = Counter()
        self.rows = 0

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        ids = input_ids.to(torch.int64)
        mask = loss_mask.to(torch.int64)
        self._rows["input_ids"].append(ids.tolist())
        self._rows["loss_mask"].append(mask.tolist())
        self._rows["seq_len"].append(int(ids.numel()))
        supervised, counts = ids[mask.bool()].unique(return_counts=True)
        self.token_freq.update(dict(zip(supervised.tolist(), counts.tolist(), strict=True)))
        self.rows += 1
        if len(self._rows["seq_len"]) >= _BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows["seq_len"]:
            self._writer.write_batch(self._pa.record_batch(self._rows, schema=self._schema))
            self._rows = {name: [] for name in self._rows}

    def finish(self, out: Storage) -> list[str]:
        """Save the table and the token frequencies into `out`'s root; returns the keys written."""
        import datasets

        self._flush()
        self._writer.close()
        saved = Path(self._dir.name) / "table"
        shown = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # the export shows its own progress
        try:
            datasets.Dataset.from_file(str(self._arrow)).with_format("torch").save_to_disk(str(saved))
        finally:
            if shown:
                datasets.enable_progress_bars()
        written = []
        for path in sorted(saved.iterdir()):
            out.write_file(path.name, path)
            written.append(path.name)
        frequencies = Path(self._dir.name) / TOKEN_FREQ
        torch.save(dict(self.token_freq), frequencies)
        out.write_file(TOKEN_FREQ, frequencies)
        written.append(TOKEN_FREQ)
        return written

    def close(self) -> None:
        self._dir.cleanup()
