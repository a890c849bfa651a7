"""How a payload gets from the producer to a specialist replica: one interface, three implementations.

The producer and the replicas hold a `Transport` and call only its methods; neither knows which one it is.
Producer side: `offer` makes a request's payload available for the replicas that will serve it and returns the
ticket the router forwards; `take` is the producer's side of a pull. Replica side: `receiver(...)` gives the
replica's end, whose `receive(ticket)` returns the payload (any number of receives at once).

  object_store  `offer` puts the payload (bytes) in Ray's object store; the ticket carries the reference, and
                whichever replica Serve picks fetches it. CPU and GPU (the codes go through host memory).
  nixl          `offer` stages the payload in the producer; the serving replica pulls it with its own call
                through Ray Direct Transport (NIXL: one-sided, no group to join, so replicas come and go with
                autoscaling; UCX on CPU, device memory on GPUs). Payloads are `codec.Wire`s: on a GPU the codes
                stay in device memory from the producer's encode to the replica's rebuild.
  cuda_ipc      the same pulls over CUDA IPC, for a producer and replicas on one GPU.

Every transport carries a payload of at most `inline_bytes` (64 KiB by default, the config's
`transport_inline_bytes`) in the ticket itself, as host bytes: the demo family's codes are ~25 KB, and one
pull costs a Ray round trip to the producer (cuda_ipc 2.5-3.4 ms, nixl 5-6 ms on an H100/H200, 15 ms on a
2-core CPU machine) where copying 25 KB off the device and back costs tens of microseconds.

There is no NCCL transport. A two-rank NCCL communicator per (producer, replica) needed a collective setup
each time a replica started, NCCL refuses two ranks on one GPU, and Ray 2.60's collective groups are known only
to the process that made them; nixl and cuda_ipc move device tensors one-sided without any of that.
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import ray

from actors.messages import Ticket

if TYPE_CHECKING:
    from scd.online import codec


class TransportError(RuntimeError):
    """The payload could not be delivered; the specialist falls back to its own prefill."""


class Receiver(Protocol):
    """A replica's end of a transport."""

    def receive(self, ticket: Ticket) -> "bytes | codec.Wire": ...


class Transport(Protocol):
    """What the producer and the replicas call, whichever transport a deployment uses."""
    name: str

    def offer(self, payload: "bytes | codec.Wire", receivers: int = 1) -> Ticket: ...

    def staged(self) -> int: ...

    def receiver(self, producer: Callable[[str | None], Any], timeout_s: float = 30.0) -> Receiver: ...


INLINE_BYTES = 64 << 10           # below Ray's own inlining limit (max_direct_call_object_size, 100 KiB)


class ObjectStoreTransport:
    """Payloads as bytes in Ray's object store. A payload of at most `inline_bytes` travels in the ticket itself,
    as Ray inlines small task arguments and returns: a put, a borrowed reference through router, replica and
    engine, and the engine's fetch from the producer cost more than copying a few kilobytes along."""
    name = "object_store"
    RECENT = 64                   # payloads whose object stays put: a prefix asked again is not put again

    def __init__(self, inline_bytes: int = INLINE_BYTES):
        self.inline_bytes = inline_bytes
        self.recent: OrderedDict[int, tuple[bytes, ray.ObjectRef]] = OrderedDict()   # id(payload) -> it, its ref
        self.lock = threading.Lock()

    def offer(self, payload: bytes, receivers: int = 1) -> Ticket:
        """One put, however many replicas fetch it; the same payload (a cached prefix's) offered again is the
        same object (it stays in the store while it is among the RECENT ones offered)."""
        if len(payload) <= self.inline_bytes:
            return Ticket("object_store", len(payload), data=payload)
        with self.lock:
            held = self.recent.get(id(payload))
            if held is not None and held[0] is payload:
                self.recent.move_to_end(id(payload))
                return Ticket("object_store", len(payload), ref=[held[1]])
        ref = ray.put(payload)
        with self.lock:
            self.recent[id(payload)] = (payload, ref)
            while len(self.recent) > self.RECENT:
                self.recent.popitem(last=False)
        return Ticket("object_store", len(payload), ref=[ref])

    def staged(self) -> int:
        return 0

    def receiver(self, producer: Callable[[str | None], Any] | None = None,
                 timeout_s: float = 30.0) -> "ObjectStoreReceiver":
        return ObjectStoreReceiver(timeout_s)


class ObjectStoreReceiver:
    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s

    def receive(self, ticket: Ticket) -> bytes:
        if ticket.kind != "object_store" or not (ticket.ref or ticket.data is not None):
            raise TransportError(f"object_store transport cannot read a {ticket.kind!r} ticket")
        data = ticket.data if ticket.data is not None else self._fetch(ticket.ref[0])
        if len(data) != ticket.nbytes:
            raise TransportError(f"object store returned {len(data)} bytes, ticket says {ticket.nbytes}")
        return data

    def _fetch(self, ref) -> bytes:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except Exception as e:                                     # lost object, timeout, owner died
            raise TransportError(f"object store fetch failed: {type(e).__name__}: {e}") from None


class NixlTransport:
    """Payloads stay in the producer, as tensors, until the replica serving the request pulls its copy through
    Ray Direct Transport with NIXL (`ray.method(tensor_transport="nixl")` on the producer's `pull`): one-sided,
    so there is no collective group to join, and replicas come and go as Serve scales them. UCX moves the
    bytes CPU to CPU here, and device memory (NVLink, RDMA) on GPUs. The replica's own call gets the tensor:
    an RDT reference cannot be handed on through another process, so the router forwards the key only.

    Payloads are `codec.Wire`s (the producer encodes them so for this transport): the header bytes beside the
    body tensor, which RDT moves where the body is: on GPUs device to device, so the replica decodes and
    rebuilds from its own device memory and the codes never touch a host."""
    name = "nixl"
    method = "pull"                      # the producer's method declared with this tensor_transport

    def __init__(self, stage_bytes: int = 256 << 20, owner: str | None = None, inline_bytes: int = INLINE_BYTES):
        self.stage, self.owner, self.inline_bytes = Staging(stage_bytes), owner, inline_bytes

    def offer(self, payload: "codec.Wire", receivers: int = 1) -> Ticket:
        """Stage a payload until each of the `receivers` replicas that serve the request has pulled it; one of
        at most `inline_bytes` goes in the ticket instead (its body copied to host bytes)."""
        from scd.online.codec import Wire
        if not isinstance(payload, Wire):
            raise TransportError(f"the {self.name} transport moves tensors: offer a codec.Wire, not "
                                 f"{type(payload).__name__}")
        if len(payload) <= self.inline_bytes:
            return Ticket(self.name, len(payload), data=payload.body.cpu().numpy().tobytes(), head=payload.head,
                          producer=self.owner)
        staged = {"head": payload.head, "body": payload.body}
        return Ticket(self.name, len(payload), key=self.stage.put(staged, len(payload), receivers),
                      producer=self.owner)

    def take(self, key: str) -> dict:
        """The producer's side of a pull: the staged {"head", "body"} (released with its last receiver's pull)."""
        return self.stage.take(key)

    def staged(self) -> int:
        return len(self.stage)

    def receiver(self, producer: Callable[[str | None], Any], timeout_s: float = 30.0) -> "RdtReceiver":
        return RdtReceiver(producer, self.name, self.method, timeout_s)


class CudaIpcTransport(NixlTransport):
    """The nixl transport's staging and pulls over CUDA IPC (`tensor_transport="cuda_ipc"` on the producer's
    `pull_ipc`), for a producer and replicas that share one GPU: the replica maps the producer's device
    memory and copies it once, device to device. Device payloads only (CUDA IPC moves CUDA tensors)."""
    name = "cuda_ipc"
    method = "pull_ipc"

    def offer(self, payload: "codec.Wire", receivers: int = 1) -> Ticket:
        from scd.online.codec import Wire
        if not isinstance(payload, Wire) or payload.body.device.type != "cuda":
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


_NIXL_PULLS = threading.Lock()        # one NIXL agent per process: see RdtReceiver.receive


class RdtReceiver:
    """A replica's end of nixl or cuda_ipc: pulls a ticket's payload from the producer that staged it (the
    ticket names it; `producer(name)` gives its handle) with its own call (the RDT transfer). A device payload
    comes back as a `codec.Wire` whose body is on this replica's device."""

    def __init__(self, producer: Callable[[str | None], Any], kind: str = "nixl", method: str = "pull",
                 timeout_s: float = 30.0):
        self.producer, self.kind, self.method, self.timeout_s = producer, kind, method, timeout_s
        self.introduced: set[str | None] = set()      # producers this process has completed a pull from
        self.first = threading.Lock()

    def receive(self, ticket: Ticket) -> "codec.Wire":
        import torch

        from scd.online.codec import Wire
        if ticket.kind != self.kind or not (ticket.key or ticket.data is not None):
            raise TransportError(f"the {self.kind} transport cannot read a {ticket.kind!r} ticket")
        if ticket.data is not None:                # carried in the ticket: a host body (the engine moves the codes)
            data = Wire(ticket.head, torch.frombuffer(bytearray(ticket.data), dtype=torch.uint8))
            if len(data) != ticket.nbytes:
                raise TransportError(f"a ticket carried {len(data)} bytes and says {ticket.nbytes}")
            return data
        if self.kind == "nixl":
            # Ray's NIXL fetch adds the producer's agent metadata anew on each pull; one pull's add invalidates
            # another's transfer in flight in this process (NIXL_ERR_NOT_FOUND, "re-registered during transfer",
            # and once a body that was not the payload's). A process's pulls go one at a time.
            with _NIXL_PULLS:
                return self._pull(ticket)
        if ticket.producer in self.introduced:
            return self._pull(ticket)
        # The first pulls from a producer, started at once from several threads, can race the exchange of its
        # metadata: the first one goes alone.
        with self.first:
            data = self._pull(ticket)
            self.introduced.add(ticket.producer)
        return data

    def _pull(self, ticket: Ticket) -> "codec.Wire":
        from scd.online.codec import Wire
        try:
            pulled = ray.get(getattr(rdt_handle(self.producer(ticket.producer)), self.method).remote(ticket.key),
                             timeout=self.timeout_s)
        except Exception as e:                                     # timeout, producer gone, transfer failed
            self.introduced.discard(ticket.producer)               # restarted, it has a new agent: go alone
            why = (e.cause or e) if isinstance(e, ray.exceptions.RayTaskError) else f"{type(e).__name__}: {e}"
            raise TransportError(f"pull failed: {why}") from None
        # cuda_ipc hands out a view of the producer's memory, freed when it drops the staged copy: take ours
        body = pulled["body"].clone() if self.kind == "cuda_ipc" else pulled["body"]
        data = Wire(pulled["head"], body)
        if len(data) != ticket.nbytes:
            raise TransportError(f"{self.kind} pull returned {len(data)} bytes, ticket says {ticket.nbytes}")
        return data


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


def make_transport(kind: str, owner: str | None = None, inline_bytes: int = INLINE_BYTES,
                   stage_bytes: int = 256 << 20):
    """The transport object for one side (producer or replica) of a deployment; `owner`: the producer's actor
    name, which its RDT tickets carry; payloads of at most `inline_bytes` ride in their tickets; an RDT
    producer holds at most `stage_bytes` of payloads not yet pulled."""
    if kind == "object_store":
        return ObjectStoreTransport(inline_bytes)
    if kind == "nixl":
        return NixlTransport(stage_bytes, owner=owner, inline_bytes=inline_bytes)
    if kind == "cuda_ipc":
        return CudaIpcTransport(stage_bytes, owner=owner, inline_bytes=inline_bytes)
    raise ValueError(f"unknown transport {kind!r}; one of {TRANSPORTS}")


def warm(kind: str) -> None:
    """Build this process's NIXL agent now, for a producer or replica started with the nixl transport: Ray's RDT
    builds it at the process's first transfer otherwise, inside that pull's timeout (seconds on a busy host,
    enough for the first request's codes to miss it). Nothing for the other transports; a failure is logged and
    left to the first pull, which falls back."""
    if kind != "nixl":
        return
    try:
        from ray.experimental.rdt.util import get_tensor_transport_manager
        get_tensor_transport_manager("NIXL").get_nixl_agent()
    except Exception as e:                                    # nixl missing or its backend failing to start
        logging.getLogger("scd.transport").warning("NIXL agent not started ahead of the first pull: %s", e)


TRANSPORTS = ("object_store", "nixl", "cuda_ipc")
RDT_TRANSPORTS = ("nixl", "cuda_ipc")     # Ray Direct Transport: replicas pull tensors from the producer
