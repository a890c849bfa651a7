"""How a payload gets from the producer to a specialist replica: one interface, three implementations.

The producer and the replicas hold a `Transport` and call only its methods; neither knows which one it is.
Producer side: `offer` makes a request's payload available and returns the ticket the router forwards;
`attach`/`detach` open and close a replica's channel; `push` sends an offered payload down one; `channels`
lists them. Replica side: `receiver(...)` gives the replica's end, whose `receive(ticket, incarnation)`
returns the payload's bytes (any number of receives at once) and `close()` leaves.

  object_store  `offer` puts the payload in Ray's object store; the ticket carries the reference, and
                whichever replica Serve picks fetches it. No channels. CPU and GPU.
  nixl          `offer` stages the payload as a tensor in the producer; the serving replica pulls it with its
                own call through Ray Direct Transport (NIXL: one-sided, no group to join; UCX on CPU, device
                memory on GPUs). CPU and GPU. A payload encoded on a GPU (`codec.Wire`) stays in device
                memory from the producer's encode to the replica's rebuild.
  cuda_ipc      the same pulls over CUDA IPC, for a producer and replicas on one GPU.
  nccl          the payload goes GPU to GPU over a two-rank NCCL communicator per (producer, replica),
                opened when the replica starts (`attach`) and torn down when it stops (so autoscaling
                works). The router cannot know which replica Serve will pick, so `offer` *stages* the
                payload and the ticket carries its key; the serving replica asks the producer to push that
                key to it and receives the bytes from its communicator: they never touch Ray. Every send
                is a frame (sequence number, size, then the bytes) on one sender thread per communicator;
                the replica's reader thread files arriving frames by sequence number, so concurrent
                receives on one communicator each take their own frame, and a receive that gave up never
                leaves the stream out of step.
  nccl_fake     the same protocol over FakeCommunicator (a hub actor stands in for the network): CPU tests
                and drills of registration, teardown, ordering and concurrent receives.
"""
from __future__ import annotations

import asyncio
import struct
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import ray
import torch

from scd.online import codec


@dataclass(frozen=True)
class Ticket:
    kind: str                      # "object_store" | "nixl" | "nccl"
    nbytes: int
    ref: list | None = None        # object_store: [ObjectRef] (in a list so Ray does not resolve it in transit)
    replica: str | None = None     # nccl: which communicator
    seq: int = 0                   # nccl: the frame's sequence number on that communicator
    key: str | None = None         # nccl, nixl: the staged payload a replica asks for


class TransportError(RuntimeError):
    """The payload could not be delivered; the specialist falls back to its own prefill."""


class Receiver(Protocol):
    """A replica's end of a transport."""

    def open(self) -> bool: ...

    def receive(self, ticket: Ticket, incarnation: str | None = None) -> bytes: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """What the producer and the replicas call, whichever transport a deployment uses."""
    name: str

    def offer(self, payload: bytes, receivers: int = 1) -> Ticket: ...

    def attach(self, replica_id: str) -> Any: ...

    def detach(self, replica_id: str) -> None: ...

    def push(self, key: str, replica_id: str) -> Ticket: ...

    def channels(self) -> list[str]: ...

    def staged(self) -> int: ...

    def receiver(self, replica_id: str, producer: Callable[[], Any], timeout_s: float = 30.0) -> Receiver: ...


class ObjectStoreTransport:
    name = "object_store"

    def offer(self, payload: bytes, receivers: int = 1) -> Ticket:
        """One put, however many replicas fetch it."""
        return Ticket("object_store", len(payload), ref=[ray.put(payload)])

    def attach(self, replica_id: str) -> None:
        raise TransportError("the object store transport has no per-replica channels")

    def detach(self, replica_id: str) -> None:
        pass

    def push(self, key: str, replica_id: str) -> Ticket:
        raise TransportError("the object store transport has nothing to push: replicas fetch by reference")

    def channels(self) -> list[str]:
        return []

    def staged(self) -> int:
        return 0

    def receiver(self, replica_id: str, producer: Callable[[], Any] | None = None,
                 timeout_s: float = 30.0) -> "ObjectStoreReceiver":
        return ObjectStoreReceiver(timeout_s)


class ObjectStoreReceiver:
    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s

    def open(self) -> bool:
        return True

    def receive(self, ticket: Ticket, incarnation: str | None = None) -> bytes:
        if ticket.kind != "object_store" or not ticket.ref:
            raise TransportError(f"object_store transport cannot read a {ticket.kind!r} ticket")
        try:
            data = ray.get(ticket.ref[0], timeout=self.timeout_s)
        except Exception as e:                                     # lost object, timeout, owner died
            raise TransportError(f"object store fetch failed: {type(e).__name__}: {e}") from None
        if len(data) != ticket.nbytes:
            raise TransportError(f"object store returned {len(data)} bytes, ticket says {ticket.nbytes}")
        return data

    def close(self) -> None:
        pass


class NixlTransport:
    """Payloads stay in the producer, as tensors, until the replica serving the request pulls its copy through
    Ray Direct Transport with NIXL (`ray.method(tensor_transport="nixl")` on the producer's `pull`): one-sided,
    so there is no collective group to join, and replicas come and go as Serve scales them. UCX moves the
    bytes CPU to CPU here, and device memory (NVLink, RDMA) on GPUs. The replica's own call gets the tensor:
    an RDT reference cannot be handed on through another process, so the router forwards the key only.

    A bytes payload is staged as a host tensor of its bytes; a device payload (`codec.Wire`, encoded on the
    producer's GPU) as its header bytes beside its body tensor, which RDT moves device to device: the
    replica decodes and rebuilds from its own device memory, and the codes never touch a host."""
    name = "nixl"
    method = "pull"                      # the producer's method declared with this tensor_transport

    def __init__(self, stage_bytes: int = 256 << 20):
        self.stage = Staging(stage_bytes)

    def offer(self, payload: "bytes | codec.Wire", receivers: int = 1) -> Ticket:
        """Stage a payload until each of the `receivers` replicas that serve the request has pulled it."""
        if isinstance(payload, codec.Wire):
            staged = {"head": payload.head, "body": payload.body}
        else:
            staged = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return Ticket(self.name, len(payload), key=self.stage.put(staged, len(payload), receivers))

    def take(self, key: str):
        """The producer's side of a pull: the staged tensor, or a device payload's {"head", "body"} (released
        with its last receiver's pull)."""
        return self.stage.take(key)

    def attach(self, replica_id: str) -> None:
        return None                                  # nothing to open: the replica pulls when it needs to

    def detach(self, replica_id: str) -> None:
        pass

    def push(self, key: str, replica_id: str) -> Ticket:
        raise TransportError(f"the {self.name} transport has nothing to push: replicas pull their payloads")

    def channels(self) -> list[str]:
        return []

    def staged(self) -> int:
        return len(self.stage)

    def receiver(self, replica_id: str, producer: Callable[[], Any], timeout_s: float = 30.0) -> "RdtReceiver":
        return RdtReceiver(producer, self.name, self.method, timeout_s)


class CudaIpcTransport(NixlTransport):
    """The nixl transport's staging and pulls over CUDA IPC (`tensor_transport="cuda_ipc"` on the producer's
    `pull_ipc`), for a producer and replicas that share one GPU: the replica maps the producer's device
    memory and copies it once, device to device. Device payloads only (CUDA IPC moves CUDA tensors)."""
    name = "cuda_ipc"
    method = "pull_ipc"

    def offer(self, payload: "bytes | codec.Wire", receivers: int = 1) -> Ticket:
        if not isinstance(payload, codec.Wire) or payload.body.device.type != "cuda":
            raise TransportError("the cuda_ipc transport carries payloads encoded on a GPU only")
        return super().offer(payload, receivers)


def rdt_handle(handle):
    """`handle` able to call the producer's RDT method. Ray 2.60 carries an actor's enable_tensor_transport in
    a handle it creates or serializes (ray-project/ray#56485), but not in one looked up by name
    (ray.get_actor), whose calls to a tensor_transport method are refused; the actor itself was created with
    it (its class declares `pull` with tensor_transport="nixl"), so the lookup's handle is marked as such."""
    if not getattr(handle, "_ray_enable_tensor_transport", True):
        handle._ray_enable_tensor_transport = True
    return handle


class RdtReceiver:
    """A replica's end of nixl or cuda_ipc: pulls a ticket's payload from the producer with its own call (the
    RDT transfer). A device payload comes back as a `codec.Wire` whose body is on this replica's device."""

    def __init__(self, producer: Callable[[], Any], kind: str = "nixl", method: str = "pull", timeout_s: float = 30.0):
        self.producer, self.kind, self.method, self.timeout_s = producer, kind, method, timeout_s

    def open(self) -> bool:
        return True

    def receive(self, ticket: Ticket, incarnation: str | None = None) -> "bytes | codec.Wire":
        if ticket.kind != self.kind or not ticket.key:
            raise TransportError(f"the {self.kind} transport cannot read a {ticket.kind!r} ticket")
        try:
            pulled = ray.get(getattr(rdt_handle(self.producer()), self.method).remote(ticket.key), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            raise TransportError(f"pull failed: {e.cause if e.cause else e}") from None
        except Exception as e:                                     # timeout, producer gone, transfer failed
            raise TransportError(f"pull failed: {type(e).__name__}: {e}") from None
        if isinstance(pulled, dict):
            # cuda_ipc hands out a view of the producer's memory, freed when it drops the staged copy: take ours
            body = pulled["body"].clone() if self.kind == "cuda_ipc" else pulled["body"]
            data = codec.Wire(pulled["head"], body)
        else:
            data = pulled.numpy().tobytes()
        if len(data) != ticket.nbytes:
            raise TransportError(f"{self.kind} pull returned {len(data)} bytes, ticket says {ticket.nbytes}")
        return data

    def close(self) -> None:
        pass


class Communicator(Protocol):
    """Two ranks, point to point, in order. Real: cupy NCCL on CUDA buffers; tests: FakeCommunicator.
    recv may raise TimeoutError when nothing arrived within its wait; the caller then asks again."""

    def send(self, data: bytes, peer: int) -> None: ...

    def recv(self, nbytes: int, peer: int) -> bytes: ...

    def close(self) -> None: ...


FRAME = struct.Struct("<QQ")        # (sequence number, payload bytes) ahead of every payload


class Staging:
    """Payloads the producer holds until each replica they were offered for has taken its copy: key -> [payload,
    takes still owed]. The oldest are dropped past `stage_bytes`; taking a dropped key fails (the replica
    falls back)."""

    def __init__(self, stage_bytes: int):
        self.items: OrderedDict[str, list] = OrderedDict()
        self.stage_bytes, self.nbytes = stage_bytes, 0
        self.lock = threading.Lock()

    def put(self, payload, size: int, receivers: int) -> str:
        if receivers < 1:
            raise ValueError(f"receivers must be >= 1, got {receivers}")
        key = uuid.uuid4().hex
        with self.lock:
            self.items[key] = [payload, receivers, size]
            self.nbytes += size
            while self.nbytes > self.stage_bytes and len(self.items) > 1:
                self.nbytes -= self.items.popitem(last=False)[1][2]
        return key

    def take(self, key: str):
        """The payload staged under `key`; its copy is released with the last take it was offered for."""
        with self.lock:
            entry = self.items.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self.items[key]
                    self.nbytes -= entry[2]
        if entry is None:
            raise TransportError(f"no staged payload {key!r} (already taken by every receiver, dropped for space, "
                                 f"or staged by an earlier producer)")
        return entry[0]

    def __len__(self) -> int:
        with self.lock:
            return len(self.items)


class NcclTransport:
    """The producer's side of the per-replica communicators (rank 0 of each), and the factory of the
    replicas' ends (rank 1). make_comm(uid, rank) builds a Communicator, blocking until both ranks joined;
    new_uid() makes the id they rendezvous on. Both come from `cupy_nccl()` on GPUs, or from the fake."""
    name = "nccl"

    def __init__(self, make_comm, new_uid, stage_bytes: int = 256 << 20, join_timeout_s: float = 30.0):
        self.make_comm, self.new_uid = make_comm, new_uid
        self.comms: dict[str, Communicator] = {}
        self.seq: dict[str, int] = {}
        self.joining: dict[str, threading.Thread] = {}
        self.senders: dict[str, ThreadPoolExecutor] = {}
        self.stage = Staging(stage_bytes)
        self.join_timeout_s = join_timeout_s
        self.lock = threading.Lock()

    def attach(self, replica_id: str):
        """Start rank 0 of a new communicator for a registering replica; returns the rendezvous id.
        Rank 0 joins in a background thread because init blocks until the replica joins as rank 1."""
        self.detach(replica_id)                      # a replica that registers again starts afresh
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

    def offer(self, payload: bytes, receivers: int = 1) -> Ticket:
        """Stage a payload until each of the `receivers` replicas that serve the request asks for it (push; a
        family's one payload serves several specialists from one staged copy). The oldest staged payloads are
        dropped past `stage_bytes`; pushing a dropped key fails (the replica falls back)."""
        return Ticket("nccl", len(payload), key=self.stage.put(payload, len(payload), receivers))

    def push(self, key: str, replica_id: str) -> Ticket:
        """Send a staged payload to a replica; returns at once with the ticket it receives with. The copy is
        released with the last push it was offered for."""
        return self.send(self.stage.take(key), replica_id)

    def send(self, payload: bytes, replica_id: str) -> Ticket:
        """Queue one frame on the replica's communicator; returns at once with its ticket."""
        pending = self.joining.pop(replica_id, None)
        if pending is not None:                      # the replica registered; rank 0 may still be joining
            pending.join(self.join_timeout_s)
        with self.lock:
            comm = self.comms.get(replica_id)
            if comm is None:
                raise TransportError(f"no NCCL communicator for replica {replica_id!r} (not registered or gone)")
            self.seq[replica_id] += 1
            seq = self.seq[replica_id]
            self.senders[replica_id].submit(_send_frame, comm, seq, payload)
        return Ticket("nccl", len(payload), replica=replica_id, seq=seq)

    def detach(self, replica_id: str) -> None:
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

    def channels(self) -> list[str]:
        """Replicas with a communicator, counting those whose rank 0 is still joining (a registered replica
        returns from its side of the rendezvous before the producer's join thread has filed the channel)."""
        with self.lock:
            joining = {rid for rid, t in list(self.joining.items()) if t.is_alive()}
            return sorted(set(self.comms) | joining)

    def staged(self) -> int:
        """Payloads offered and not yet pushed to every receiver they were offered for."""
        return len(self.stage)

    def receiver(self, replica_id: str, producer: Callable[[], Any], timeout_s: float = 30.0) -> "NcclReceiver":
        return NcclReceiver(self.make_comm, replica_id, producer, timeout_s)


def _send_frame(comm: Communicator, seq: int, payload: bytes) -> None:
    comm.send(FRAME.pack(seq, len(payload)), 1)
    comm.send(payload, 1)


class _Inbox:
    """Rank 1 of one communicator: a reader thread files arriving frames by sequence number until closed."""

    def __init__(self, comm: Communicator):
        self.comm, self.frames, self.abandoned = comm, {}, set()
        self.cond = threading.Condition()
        self.error: str | None = None
        self.closed = False
        threading.Thread(target=self._read, daemon=True, name="nccl-inbox").start()

    def _recv(self, nbytes: int) -> bytes | None:
        while not self.closed:
            try:
                return self.comm.recv(nbytes, 0)
            except TimeoutError:
                continue
        return None

    def _read(self) -> None:
        try:
            while (head := self._recv(FRAME.size)) is not None:
                seq, n = FRAME.unpack(head)
                data = self._recv(n)
                with self.cond:
                    if seq in self.abandoned:
                        self.abandoned.discard(seq)
                    elif data is not None:
                        self.frames[seq] = data
                    self.cond.notify_all()
        except Exception as e:                              # noqa: BLE001 - a broken communicator
            with self.cond:
                self.error = f"{type(e).__name__}: {e}"
                self.cond.notify_all()

    def take(self, ticket: Ticket, timeout_s: float) -> bytes:
        with self.cond:
            ok = self.cond.wait_for(lambda: ticket.seq in self.frames or self.error or self.closed, timeout_s)
            data = self.frames.pop(ticket.seq, None)
            if data is None:
                if not ok:
                    self.abandoned.add(ticket.seq)          # the frame is dropped when it arrives
                raise TransportError(self.error or ("communicator closed" if self.closed else
                                                    f"frame #{ticket.seq} did not arrive within {timeout_s}s"))
        if len(data) != ticket.nbytes:
            raise TransportError(f"received a {len(data)}-byte payload, ticket says {ticket.nbytes}")
        return data

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.comm.close()


class NcclReceiver:
    """A replica's end: registers with the producer (again when the producer is a new incarnation), asks it
    to push each request's staged payload, and takes that payload's frame from its inbox."""

    def __init__(self, make_comm, replica_id: str, producer: Callable[[], Any], timeout_s: float = 30.0):
        self.make_comm, self.replica_id, self.producer, self.timeout_s = make_comm, replica_id, producer, timeout_s
        self.inbox: _Inbox | None = None
        self.incarnation: str | None = None          # the producer incarnation our communicator belongs to
        self.lock = threading.Lock()                 # registration only; receives run concurrently

    def open(self) -> bool:
        """Build this replica's communicator with the producer. False if the producer is not reachable:
        receives then fail (the request falls back) and the next receive tries again."""
        with self.lock:
            return self._open()

    def _open(self) -> bool:
        self._drop()
        try:
            producer = self.producer()
            incarnation = ray.get(producer.stats.remote(), timeout=self.timeout_s)["incarnation"]
            uid = ray.get(producer.register.remote(self.replica_id), timeout=self.timeout_s)
            self.inbox = _Inbox(self.make_comm(uid, 1))
        except Exception:                                   # noqa: BLE001 - any failure: not connected
            return False
        self.incarnation = incarnation
        return True

    def receive(self, ticket: Ticket, incarnation: str | None = None) -> bytes:
        if ticket.kind != "nccl" or not ticket.key:
            raise TransportError(f"the nccl transport cannot read a {ticket.kind!r} ticket")
        with self.lock:
            if (self.inbox is None or self.inbox.error or self.incarnation != incarnation) and not self._open():
                raise TransportError(f"replica {self.replica_id} has no communicator with the producer")
            inbox = self.inbox
        try:
            sent = ray.get(self.producer().push.remote(ticket.key, self.replica_id), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            raise TransportError(f"push failed: {e.cause if e.cause else e}") from None
        except ray.exceptions.RayError as e:
            raise TransportError(f"push failed: {type(e).__name__}") from None
        return inbox.take(sent, self.timeout_s)

    def _drop(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self.inbox, self.incarnation = None, None

    def close(self) -> None:
        """Leave: the producer frees its side, and ours is closed."""
        with self.lock:
            if self.inbox is not None:
                try:
                    self.producer().unregister.remote(self.replica_id)
                except Exception:                           # noqa: BLE001 - the producer may be gone
                    pass
            self._drop()


# -- a fake communicator for CPU tests: rendezvous and queues live in a Ray actor ------------------------

@ray.remote(num_cpus=0)
class FakeNcclHub:
    """Stands in for the NCCL network: per (uid, destination rank) FIFO queues of byte strings. An asyncio
    actor, so a receive waits for its frame inside the hub instead of polling it (polling from every
    replica's reader thread used to keep both cores of a CI box busy)."""

    def __init__(self):
        self.queues: dict[tuple, list[bytes]] = {}
        self.arrived: dict[tuple, asyncio.Condition] = {}
        self.joined: dict[str, set] = {}

    def _queue(self, uid: str, dst: int) -> tuple[list[bytes], asyncio.Condition]:
        key = (uid, dst)
        if key not in self.arrived:
            self.queues[key], self.arrived[key] = [], asyncio.Condition()
        return self.queues[key], self.arrived[key]

    async def join(self, uid: str, rank: int) -> int:
        self.joined.setdefault(uid, set()).add(rank)
        return len(self.joined[uid])

    async def put(self, uid: str, dst: int, data: bytes) -> None:
        q, arrived = self._queue(uid, dst)
        async with arrived:
            q.append(data)
            arrived.notify_all()

    async def take(self, uid: str, dst: int, timeout_s: float = 0.0) -> bytes | None:
        """The oldest frame for (uid, dst), waiting up to timeout_s for one; None if none came."""
        q, arrived = self._queue(uid, dst)
        async with arrived:
            try:
                await asyncio.wait_for(arrived.wait_for(lambda: bool(q)), timeout_s)
            except asyncio.TimeoutError:
                return None
            return q.pop(0)

    def open_communicators(self) -> int:
        return sum(len(r) == 2 for r in self.joined.values())

    def leave(self, uid: str, rank: int) -> None:
        self.joined.get(uid, set()).discard(rank)


class FakeCommunicator:
    """A Communicator over FakeNcclHub; like NCCL init, construction blocks until both ranks joined."""

    def __init__(self, hub, uid: str, rank: int, timeout_s: float = 30.0):
        self.hub, self.uid, self.rank = hub, uid, rank
        ray.get(hub.join.remote(uid, rank))
        deadline = time.monotonic() + timeout_s
        while ray.get(hub.join.remote(uid, rank)) < 2:
            if time.monotonic() > deadline:
                raise TransportError(f"peer of rank {rank} never joined communicator {uid}")
            time.sleep(0.01)

    def send(self, data: bytes, peer: int) -> None:
        ray.get(self.hub.put.remote(self.uid, peer, data))

    def recv(self, nbytes: int, peer: int, timeout_s: float = 1.0) -> bytes:
        data = ray.get(self.hub.take.remote(self.uid, self.rank, timeout_s))
        if data is None:
            raise TimeoutError(f"rank {self.rank} waited {timeout_s}s for {nbytes} bytes")
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
            self.comm.abort()             # not destroy(): the replica's reader may be blocked in a recv

    return CupyCommunicator, nccl.get_unique_id


TRANSPORTS = ("object_store", "nixl", "cuda_ipc", "nccl", "nccl_fake")
RDT_TRANSPORTS = ("nixl", "cuda_ipc")     # Ray Direct Transport: replicas pull tensors from the producer
FAKE_HUB_NAME = "scd-fake-nccl"


def make_transport(kind: str, namespace: str | None = None):
    """The transport object for one side (producer or replica) of a deployment."""
    if kind == "object_store":
        return ObjectStoreTransport()
    if kind == "nixl":
        return NixlTransport()
    if kind == "cuda_ipc":
        return CudaIpcTransport()
    if kind == "nccl":
        return NcclTransport(*cupy_nccl())
    if kind == "nccl_fake":
        hub = FakeNcclHub.options(name=FAKE_HUB_NAME, namespace=namespace, get_if_exists=True,
                                  lifetime="detached").remote()
        return NcclTransport(*fake_nccl(hub))
    raise ValueError(f"unknown transport {kind!r}; one of {TRANSPORTS}")
