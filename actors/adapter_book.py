"""AdapterBook: the LoRA adapters loaded into groups at run time (`POST /v1/load_lora_adapter`).

One detached named actor per deployment (its Ray namespace). It lists each loaded adapter's name, group and
folder: every replica of a group loads what it lists for its group (at its start, and within `SYNC_S` of a
change, or at once when a request names an adapter it does not hold yet), and every router replica serves the
names it lists. It also keeps a note per adapter (its calibration job, or why there is none) that every router
replica's /healthz shows. `serve_app.app.undeploy` kills it with the rest of the deployment.
"""
from __future__ import annotations

import ray

BOOK_NAME = "scd-adapter-book"
SYNC_S = 1.0                  # how often group replicas and routers read the book


@ray.remote(num_cpus=0)
class AdapterBook:
    def __init__(self):
        self.entries: dict[str, tuple[str, str]] = {}       # adapter name -> (group, folder)
        self.notes: dict[str, str] = {}                     # adapter name -> its calibration job, or why none

    def add(self, name: str, group: str, path: str) -> None:
        if name in self.entries:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        self.entries[name] = (group, path)

    def remove(self, name: str) -> None:
        self.entries.pop(name, None)
        self.notes.pop(name, None)

    def listing(self) -> dict[str, tuple[str, str]]:
        return dict(self.entries)

    def note(self, name: str, text: str) -> None:
        if name in self.entries:
            self.notes[name] = text

    def calibrations(self) -> dict[str, str]:
        return dict(self.notes)


def book(namespace: str | None):
    """The deployment's book, created by whoever asks first."""
    return AdapterBook.options(name=BOOK_NAME, namespace=namespace, lifetime="detached",
                               get_if_exists=True).remote()


def stop_book(namespace: str | None) -> None:
    try:
        ray.kill(ray.get_actor(BOOK_NAME, namespace=namespace))
    except ValueError:
        pass
