"""Fault drills shared by tests and game days: a gate that holds requests open until it is opened.

A specialist replica told to hold (`inject("hold:<gate name>")`) makes each request it starts wait on the
named gate, so a test can keep N requests in flight for as long as it needs, on a fast or a slow machine.
"""
from __future__ import annotations

import asyncio

import ray

HOLD_LIMIT_S = 600.0                 # a gate nobody opens releases its requests after this, never hangs them


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self):
        self.opened = asyncio.Event()
        self.waiting = 0

    async def wait(self, limit_s: float = HOLD_LIMIT_S) -> bool:
        """Returns when the gate opens (True) or after `limit_s` (False)."""
        self.waiting += 1
        try:
            await asyncio.wait_for(self.opened.wait(), limit_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting -= 1

    def open(self) -> None:
        self.opened.set()

    def held(self) -> int:
        return self.waiting


def hold_until_open(name: str, namespace: str | None) -> None:
    try:
        gate = ray.get_actor(name, namespace=namespace)
    except ValueError:                # the gate is gone: nothing to wait for
        return
    ray.get(gate.wait.remote(), timeout=HOLD_LIMIT_S + 10)
