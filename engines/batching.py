"""The decode loop of a serving engine on its own thread: scd.online.decode.Decoder stepped while it has
rows, waiting for new ones otherwise. Requests join from other threads (`submit`)."""
from __future__ import annotations

import threading

from scd.online.decode import Decoder, Row


class BatchDecoder:
    """One thread per engine runs the Decoder's steps; `submit` queues a row for the next step."""

    def __init__(self, model, eos_id: int | None, max_batch: int = 8, static_capacity: int | None = None,
                 graphs: bool = False):
        self.decoder = Decoder(model, eos_id, max_batch, static_capacity, graphs)
        self.cond = threading.Condition()
        self.stopped = False
        threading.Thread(target=self._loop, daemon=True, name="decode-loop").start()

    def stop(self) -> None:
        """End the loop; the rows running or waiting end with an error event."""
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def stats(self) -> dict:
        """The batched steps so far, the rows they carried and the mean batch."""
        d = self.decoder
        return {"steps": d.steps, "rows": d.rows_stepped, "mean_batch": round(d.rows_stepped / max(1, d.steps), 2)}

    def submit(self, row: Row) -> None:
        with self.cond:
            self.decoder.waiting.append(row)
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopped or self.decoder.busy())
                if self.stopped:
                    for row in [*self.decoder.batch.rows, *self.decoder.waiting]:
                        row.on_done("error: the engine stopped", row.n_out)
                    return
                self.decoder.admit()                 # under the lock: submit() appends to the same queue
            self.decoder.step()
