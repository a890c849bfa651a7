"""How a payload gets from the producer to a specialist replica.

  object_store  the producer puts the payload in Ray's object store and returns a ticket carrying the
                reference; the router hands it to whichever replica Serve picks, which fetches it. CPU and GPU.
  nccl          the payload goes GPU to GPU over a two-rank NCCL communicator per (producer, replica),
                created when the replica registers and destroyed when it leaves (so autoscaling works).
                The router cannot know which replica Serve will pick, so the producer *stages* the payload
                and returns a ticket with its key; the chosen replica asks the producer to push that key to
                it, gets back a ticket with (replica, sequence number, byte count), and receives the bytes
                from its communicator: they never touch Ray. Sends run on one thread per communicator, so
                they are in order and the producer never blocks on a receiver.
  nccl_fake     the same protocol over FakeCommunicator (a hub actor stands in for the network): CPU tests
                and drills of registration, teardown and ordering.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import ray


@dataclass(frozen=True)
class Ticket:
    kind: str                      # "object_store" | "nccl"
    nbytes: int
    ref: list | None = None        # object_store: [ObjectRef] (in a list so Ray does not resolve it in transit)
    replica: str | None = None     # nccl: which communicator
    seq: int = 0                   # nccl: position in that communicator's stream of sends
    key: str | None = None         # nccl: the staged payload a replica asks the producer to push


class TransportError(RuntimeError):
    """The payload could not be delivered; the specialist falls back to its own prefill."""


class ObjectStoreTransport:
    name = "object_store"

    def send(self, payload: bytes, replica_id: str | None = None) -> Ticket:
        return Ticket("object_store", len(payload), ref=[ray.put(payload)])

    def recv(self, ticket: Ticket, timeout_s: float = 30.0) -> bytes:
        if ticket.kind != "object_store" or not ticket.ref:
            raise TransportError(f"object_store transport cannot read a {ticket.kind!r} ticket")
        try:
            data = ray.get(ticket.ref[0], timeout=timeout_s)
        except Exception as e:                                     # lost object, timeout, owner died
            raise TransportError(f"object store fetch failed: {type(e).__name__}: {e}") from None
        if len(data) != ticket.nbytes:
            raise TransportError(f"object store returned {len(data)} bytes, ticket says {ticket.nbytes}")
        return data


class Communicator(Protocol):
    """Two ranks, point to point, in order. Real: cupy NCCL on CUDA buffers; tests: FakeCommunicator."""

    def send(self, data: bytes, peer: int) -> None: ...

    def recv(self, nbytes: int, peer: int) -> bytes: ...

    def close(self) -> None: ...


class NcclTransport:
    """One side of the per-replica communicators. The producer is rank 0, each replica rank 1 of its own pair.

    make_comm(uid, rank) builds a Communicator (blocking until both ranks joined); new_uid() makes the id
    the two ranks rendezvous on. Both come from `cupy_nccl()` on GPUs, or from the fake on CPU.
    """
    name = "nccl"

    def __init__(self, make_comm, new_uid, stage_bytes: int = 256 << 20):
        self.make_comm, self.new_uid = make_comm, new_uid
        self.comms: dict[str, Communicator] = {}
        self.seq: dict[str, int] = {}
        self.joining: dict[str, threading.Thread] = {}
        self.senders: dict[str, ThreadPoolExecutor] = {}
        self.staged: OrderedDict[str, bytes] = OrderedDict()
        self.stage_bytes, self.staged_total = stage_bytes, 0
        self.lock = threading.Lock()

    # producer side ---------------------------------------------------------------------------------
    def open_for(self, replica_id: str):
        """Start rank 0 of a new communicator for a registering replica; returns the rendezvous id.
        Rank 0 joins in a background thread because init blocks until the replica joins as rank 1."""
        self.close_for(replica_id)                   # a replica that registers again starts afresh
        uid = self.new_uid()

        def join():
            comm = self.make_comm(uid, 0)
            with self.lock:
                self.comms[replica_id], self.seq[replica_id] = comm, 0
                self.senders[replica_id] = ThreadPoolExecutor(1, thread_name_prefix=f"nccl-send-{replica_id}")
        t = threading.Thread(target=join, daemon=True, name=f"nccl-join-{replica_id}")
        self.joining[replica_id] = t
        t.start()
        return uid

    def stage(self, payload: bytes) -> Ticket:
        """Hold a payload until the replica that serves the request asks for it (push). The oldest staged
        payloads are dropped past `stage_bytes`; pushing a dropped key fails (the replica falls back)."""
        key = uuid.uuid4().hex
        with self.lock:
            self.staged[key] = payload
            self.staged_total += len(payload)
            while self.staged_total > self.stage_bytes and len(self.staged) > 1:
                self.staged_total -= len(self.staged.popitem(last=False)[1])
        return Ticket("nccl", len(payload), key=key)

    def push(self, key: str, replica_id: str, join_timeout_s: float = 30.0) -> Ticket:
        """Send a staged payload to a replica; returns the ticket it receives with."""
        with self.lock:
            payload = self.staged.pop(key, None)
            if payload is not None:
                self.staged_total -= len(payload)
        if payload is None:
            raise TransportError(f"no staged payload {key!r} (already pushed, or dropped for space)")
        return self.send(payload, replica_id, join_timeout_s)

    def send(self, payload: bytes, replica_id: str | None = None, join_timeout_s: float = 30.0) -> Ticket:
        """Queue a payload on the replica's communicator; returns at once with its ticket."""
        pending = self.joining.pop(replica_id, None)
        if pending is not None:                      # the replica registered; rank 0 may still be joining
            pending.join(join_timeout_s)
        with self.lock:
            comm = self.comms.get(replica_id)
            if comm is None:
                raise TransportError(f"no NCCL communicator for replica {replica_id!r} (not registered or gone)")
            self.seq[replica_id] += 1
            seq = self.seq[replica_id]
            self.senders[replica_id].submit(comm.send, len(payload).to_bytes(8, "little") + payload, 1)
        return Ticket("nccl", len(payload), replica=replica_id, seq=seq)

    def close_for(self, replica_id: str) -> None:
        """Tear down a replica's communicator (after the sends already queued on it)."""
        self.joining.pop(replica_id, None)
        with self.lock:
            comm = self.comms.pop(replica_id, None)
            sender = self.senders.pop(replica_id, None)
            self.seq.pop(replica_id, None)
        if sender is not None:
            sender.shutdown(wait=True)
        if comm is not None:
            comm.close()

    def open_replicas(self) -> list[str]:
        with self.lock:
            return sorted(self.comms)

    # replica side ----------------------------------------------------------------------------------
    def join(self, replica_id: str, uid) -> None:
        self.comms[replica_id], self.seq[replica_id] = self.make_comm(uid, 1), 0

    def recv(self, ticket: Ticket, timeout_s: float = 30.0) -> bytes:
        comm = self.comms.get(ticket.replica)
        if ticket.kind != "nccl" or comm is None:
            raise TransportError(f"this replica has no communicator for ticket {ticket}")
        self.seq[ticket.replica] += 1
        if self.seq[ticket.replica] != ticket.seq:
            raise TransportError(f"out of order: expected send #{self.seq[ticket.replica]}, ticket is #{ticket.seq}")
        framed = comm.recv(8 + ticket.nbytes, 0)
        n = int.from_bytes(framed[:8], "little")
        if n != ticket.nbytes:
            raise TransportError(f"received a {n}-byte payload, ticket says {ticket.nbytes}")
        return framed[8:]

    def leave(self, replica_id: str) -> None:
        comm = self.comms.pop(replica_id, None)
        self.seq.pop(replica_id, None)
        if comm is not None:
            comm.close()


# -- a fake communicator for CPU tests: rendezvous and queues live in a Ray actor ------------------------

@ray.remote(num_cpus=0)
class FakeNcclHub:
    """Stands in for the NCCL network: per (uid, destination rank) FIFO queues of byte strings."""

    def __init__(self):
        self.queues: dict[tuple, list[bytes]] = {}
        self.joined: dict[str, set] = {}

    def join(self, uid: str, rank: int) -> int:
        self.joined.setdefault(uid, set()).add(rank)
        return len(self.joined[uid])

    def put(self, uid: str, dst: int, data: bytes) -> None:
        self.queues.setdefault((uid, dst), []).append(data)

    def take(self, uid: str, dst: int) -> bytes | None:
        q = self.queues.get((uid, dst))
        return q.pop(0) if q else None

    def open_communicators(self) -> int:
        return sum(len(r) == 2 for r in self.joined.values())

    def leave(self, uid: str, rank: int) -> None:
        self.joined.get(uid, set()).discard(rank)


class FakeCommunicator:
    """A Communicator over FakeNcclHub; like NCCL init, construction blocks until both ranks joined."""

    def __init__(self, hub, uid: str, rank: int, timeout_s: float = 30.0):
        import time
        self.hub, self.uid, self.rank = hub, uid, rank
        ray.get(hub.join.remote(uid, rank))
        deadline = time.monotonic() + timeout_s
        while ray.get(hub.join.remote(uid, rank)) < 2:
            if time.monotonic() > deadline:
                raise TransportError(f"peer of rank {rank} never joined communicator {uid}")
            time.sleep(0.01)

    def send(self, data: bytes, peer: int) -> None:
        ray.get(self.hub.put.remote(self.uid, peer, data))

    def recv(self, nbytes: int, peer: int, timeout_s: float = 30.0) -> bytes:
        import time
        deadline = time.monotonic() + timeout_s
        while (data := ray.get(self.hub.take.remote(self.uid, self.rank))) is None:
            if time.monotonic() > deadline:
                raise TransportError(f"rank {self.rank} waited {timeout_s}s for {nbytes} bytes")
            time.sleep(0.005)
        if len(data) != nbytes:
            raise TransportError(f"expected {nbytes} bytes, got {len(data)}")
        return data

    def close(self) -> None:
        ray.get(self.hub.leave.remote(self.uid, self.rank))


def fake_nccl(hub) -> tuple:
    """(make_comm, new_uid) for NcclTransport backed by a FakeNcclHub actor."""
    return (lambda uid, rank: FakeCommunicator(hub, uid, rank)), (lambda: uuid.uuid4().hex)


def cupy_nccl() -> tuple:
    """(make_comm, new_uid) over cupy's NCCL bindings; only on a CUDA device with cupy installed."""
    import cupy
    from cupy.cuda import nccl

    class CupyCommunicator:
        def __init__(self, uid, rank):
            self.comm = nccl.NcclCommunicator(2, uid, rank)
            self.stream = cupy.cuda.Stream(non_blocking=True)

        def send(self, data: bytes, peer: int) -> None:
            import numpy as np
            buf = cupy.asarray(np.frombuffer(data, dtype=np.uint8))      # host -> device copy of the payload
            self.comm.send(buf.data.ptr, buf.size, nccl.NCCL_UINT8, peer, self.stream.ptr)
            self.stream.synchronize()

        def recv(self, nbytes: int, peer: int) -> bytes:
            buf = cupy.empty(nbytes, dtype=cupy.uint8)
            self.comm.recv(buf.data.ptr, nbytes, nccl.NCCL_UINT8, peer, self.stream.ptr)
            self.stream.synchronize()
            return cupy.asnumpy(buf).tobytes()

        def close(self) -> None:
            self.comm.destroy()

    return CupyCommunicator, nccl.get_unique_id


TRANSPORTS = ("object_store", "nccl", "nccl_fake")
FAKE_HUB_NAME = "scd-fake-nccl"


def make_transport(kind: str, namespace: str | None = None):
    """The transport object for one side (producer or replica) of a deployment."""
    if kind == "object_store":
        return ObjectStoreTransport()
    if kind == "nccl":
        return NcclTransport(*cupy_nccl())
    if kind == "nccl_fake":
        hub = FakeNcclHub.options(name=FAKE_HUB_NAME, namespace=namespace, get_if_exists=True,
                                  lifetime="detached").remote()
        return NcclTransport(*fake_nccl(hub))
    raise ValueError(f"unknown transport {kind!r}; one of {TRANSPORTS}")
