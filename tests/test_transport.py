"""Transports on a real local Ray, through the one interface the producer and the replicas call: object
store, NIXL through Ray Direct Transport (on CPU, over UCX), and the NCCL protocol over a fake communicator
(registration, framing, concurrent receives, leave)."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from actors.transport import (CudaIpcTransport, FakeNcclHub, NcclTransport, NixlTransport, ObjectStoreTransport,
                              Ticket, TransportError, fake_nccl)
from scd.online import codec
from tests.test_codec import DIMS, PLAN, _codes


def _transport(kind, hub):
    return {"object_store": ObjectStoreTransport, "nixl": NixlTransport, "cuda_ipc": CudaIpcTransport}.get(
        kind, lambda: NcclTransport(*fake_nccl(hub)))()


@ray.remote(num_cpus=0, max_concurrency=8)
class Producer:
    """The producer actor's transport calls (register / unregister / push / stats), around any Transport."""

    def __init__(self, kind, hub=None):
        self.t = _transport(kind, hub)
        self.incarnation = "p1"

    def offer(self, payload, receivers=1):
        return self.t.offer(payload, receivers)

    def staged(self):
        return self.t.staged(), self.t.stage.nbytes

    def register(self, rid):
        return self.t.attach(rid)

    def unregister(self, rid):
        self.t.detach(rid)

    def push(self, key, rid):
        return self.t.push(key, rid)

    def offer_codes(self, receivers=1, device="cpu"):
        """A device payload of a small set of codes, encoded here (on `device`); returns (ticket, its bytes)."""
        c = _codes()
        c.token_ids, c.mask = c.token_ids.to(device), c.mask.to(device)
        c.layers = {l: {k: x.to(device) for k, x in fields.items()} for l, fields in c.layers.items()}
        wire = codec.encode_wire(c, "base:qa", "v3", DIMS, "int8")
        assert wire.body.device.type == device
        return self.t.offer(wire, receivers), wire.head, wire.body.cpu().numpy().tobytes()

    @ray.method(tensor_transport="nixl")
    def pull(self, key):
        return self.t.take(key)

    @ray.method(tensor_transport="cuda_ipc")
    def pull_ipc(self, key):
        return self.t.take(key)

    def stats(self):
        return {"incarnation": self.incarnation, "channels": self.t.channels()}


@ray.remote(num_cpus=0, max_concurrency=8)
class Replica:
    """A specialist replica's end of the transport, in its own process, not told which transport it is."""

    def __init__(self, kind, hub, rid, producer, timeout_s=120.0):    # only a failure waits this long
        self.r = _transport(kind, hub).receiver(rid, lambda: producer, timeout_s)

    def open(self):
        return self.r.open()

    def receive(self, ticket, incarnation="p1"):
        return self.r.receive(ticket, incarnation)

    def decode(self, ticket):
        """Receive a device payload and decode it where it arrived: (its body's device, head, body bytes, ids)."""
        wire = self.r.receive(ticket)
        codes = codec.decode(wire, "base:qa", "v3", PLAN, DIMS)
        return str(wire.body.device), wire.head, wire.body.cpu().numpy().tobytes(), codes.token_ids.cpu()

    def receive_many(self, tickets):
        with ThreadPoolExecutor(len(tickets)) as pool:
            return list(pool.map(self.r.receive, tickets, ["p1"] * len(tickets)))

    def close(self):
        self.r.close()


def test_object_store_round_trip_across_processes(ray_cluster):
    producer = Producer.remote("object_store")
    replica = Replica.remote("object_store", None, "qa#1", producer)
    assert ray.get(replica.open.remote()) and ray.get(producer.stats.remote())["channels"] == []
    ticket = ray.get(producer.offer.remote(b"\x00codes" * 1000))
    assert ray.get(replica.receive.remote(ticket)) == b"\x00codes" * 1000
    with pytest.raises(ray.exceptions.RayTaskError, match="ticket says 5"):
        ray.get(replica.receive.remote(Ticket("object_store", 5, ref=ticket.ref)))


def test_nccl_register_push_receive_concurrently_and_leave_over_a_fake_communicator(ray_cluster):
    hub = FakeNcclHub.remote()
    producer = Producer.remote("nccl", hub)
    replicas = {rid: Replica.remote("nccl", hub, rid, producer) for rid in ("qa#1", "qa#2")}
    assert all(ray.get([r.open.remote() for r in replicas.values()]))
    assert ray.get(producer.stats.remote())["channels"] == ["qa#1", "qa#2"]
    assert ray.get(hub.open_communicators.remote()) == 2
    for i in range(2):                               # payloads offered, then pushed to whichever replica serves
        for rid, r in replicas.items():
            payload = f"{rid}-{i}".encode() * 50
            assert ray.get(r.receive.remote(ray.get(producer.offer.remote(payload)))) == payload
    # eight receives at once on one communicator: each request gets its own payload back
    payloads = [f"request {i} ".encode() * (10 + i) for i in range(8)]
    tickets = ray.get([producer.offer.remote(p) for p in payloads])
    assert ray.get(replicas["qa#1"].receive_many.remote(tickets)) == payloads
    # a payload pushed once is gone: a second receive of its ticket fails with a stated reason
    with pytest.raises(ray.exceptions.RayTaskError, match="no staged payload"):
        ray.get(replicas["qa#1"].receive.remote(tickets[0]))
    # the replica leaves (scale-down): the producer's side goes too, and pushes to it fail
    ray.get(replicas["qa#2"].close.remote())
    assert ray.get(producer.stats.remote())["channels"] == ["qa#1"]
    ticket = ray.get(producer.offer.remote(b"x"))
    with pytest.raises(ray.exceptions.RayTaskError, match="qa#2"):
        ray.get(producer.push.remote(ticket.key, "qa#2"))
    assert ray.get(hub.open_communicators.remote()) == 1


def test_nccl_stages_a_family_payload_once_for_every_member_replica(ray_cluster):
    """One payload for a fan-out to three specialists of a family: one staged copy, pushed to each member's
    replica, released with the last push; a push beyond the receivers it was offered for fails."""
    hub = FakeNcclHub.remote()
    producer = Producer.remote("nccl", hub)
    replicas = [Replica.remote("nccl", hub, rid, producer) for rid in ("qa#1", "prose#1", "code#1")]
    assert all(ray.get([r.open.remote() for r in replicas]))
    payload = b"one family code " * 64
    ticket = ray.get(producer.offer.remote(payload, 3))
    assert ray.get(producer.staged.remote()) == (1, len(payload))
    assert ray.get([r.receive.remote(ticket) for r in replicas[:2]]) == [payload, payload]
    assert ray.get(producer.staged.remote()) == (1, len(payload))        # one receiver still owed
    assert ray.get(replicas[2].receive.remote(ticket)) == payload
    assert ray.get(producer.staged.remote()) == (0, 0)
    with pytest.raises(ray.exceptions.RayTaskError, match="already taken by every receiver"):
        ray.get(replicas[0].receive.remote(ticket))
    with pytest.raises(ray.exceptions.RayTaskError, match="receivers must be >= 1"):
        ray.get(producer.offer.remote(payload, 0))
    ray.get([r.close.remote() for r in replicas])


def test_nccl_receive_that_gives_up_does_not_put_the_stream_out_of_step(ray_cluster):
    """A frame whose receiver stopped waiting is dropped when it arrives; the next receive gets its own."""
    from actors.transport import FRAME, _Inbox

    class Slow:                                      # a communicator whose first frame arrives late
        def __init__(self, frames):
            self.frames, self.calls = list(frames), 0

        def recv(self, nbytes, peer):
            import time
            self.calls += 1
            if self.calls <= 2:
                time.sleep(0.3)
            if not self.frames:
                raise TimeoutError
            data = self.frames.pop(0)
            assert len(data) == nbytes
            return data

        def close(self):
            pass

    inbox = _Inbox(Slow([FRAME.pack(1, 5), b"first", FRAME.pack(2, 6), b"second"]))
    with pytest.raises(TransportError, match="did not arrive"):
        inbox.take(Ticket("nccl", 5, replica="r", seq=1), timeout_s=0.05)
    assert inbox.take(Ticket("nccl", 6, replica="r", seq=2), timeout_s=60) == b"second"
    assert inbox.frames == {} and inbox.abandoned == set()
    with pytest.raises(TransportError, match="ticket says 7"):
        inbox.frames[3] = b"third"
        inbox.take(Ticket("nccl", 7, replica="r", seq=3), timeout_s=1)
    inbox.close()


def test_nixl_replicas_pull_their_payloads_and_a_family_payload_is_staged_once(ray_cluster):
    """Two replicas, each in its own process, pull payloads through Ray Direct Transport (NIXL on CPU): bytes
    intact, concurrently; a payload offered for three receivers stays staged until the third pull; a key
    no longer staged is a TransportError (the request falls back), not a hang."""
    p = Producer.remote("nixl")
    a, b = (Replica.remote("nixl", None, rid, p) for rid in ("qa#1", "prose#1"))
    payloads = [bytes([i]) * (1000 + 37 * i) for i in range(4)]
    tickets = [ray.get(p.offer.remote(x)) for x in payloads]
    assert {t.kind for t in tickets} == {"nixl"} and ray.get(p.staged.remote()) == (4, sum(map(len, payloads)))
    got = ray.get([a.receive_many.remote(tickets[:2]), b.receive_many.remote(tickets[2:])])
    assert got[0] + got[1] == payloads
    assert ray.get(p.staged.remote()) == (0, 0), "every pulled payload is released"
    family = ray.get(p.offer.remote(b"f" * 5000, 3))
    assert ray.get(a.receive.remote(family)) == b"f" * 5000 and ray.get(b.receive.remote(family)) == b"f" * 5000
    assert ray.get(p.staged.remote()) == (1, 5000), "staged until its third receiver pulls"
    assert ray.get(a.receive.remote(family)) == b"f" * 5000 and ray.get(p.staged.remote()) == (0, 0)
    with pytest.raises(TransportError, match="no staged payload"):
        ray.get(a.receive.remote(family))
    with pytest.raises(TransportError, match="cannot read"):
        ray.get(a.receive.remote(Ticket("object_store", 3)))


def pull_device_payloads(kind: str, device: str) -> list:
    """A device payload encoded in the producer on `device`, pulled by two replicas (a family's one payload for
    both) and decoded where it arrived; returns where each body arrived. Shared with the GPU tests."""
    gpus = 0.25 if device == "cuda" else 0                 # all on one GPU (cuda_ipc needs that; nixl does not)
    p = Producer.options(num_gpus=gpus).remote(kind)
    a, b = (Replica.options(num_gpus=gpus).remote(kind, None, rid, p) for rid in ("qa#1", "prose#1"))
    ticket, head, body = ray.get(p.offer_codes.remote(2, device))
    assert ticket.kind == kind and ticket.nbytes == len(head) + len(body)
    arrived = []
    for r in (a, b):
        where, got_head, got_body, ids = ray.get(r.decode.remote(ticket))
        assert got_head == head and got_body == body, f"{kind}: the payload changed on its way ({where})"
        assert torch.equal(ids, _codes().token_ids), "decoded token ids differ from the encoded ones"
        arrived.append(where)
    assert ray.get(p.staged.remote()) == (0, 0), "released after its second receiver's pull"
    return arrived


def test_nixl_moves_a_device_payload_as_a_tensor_and_the_replica_decodes_it(ray_cluster):
    """A `codec.Wire` (the body a tensor where it was encoded) over nixl: its header and body arrive intact, the
    replica decodes it where it landed (here the host; on a GPU, device memory: tests/test_gpu.py)."""
    assert pull_device_payloads("nixl", "cpu") == ["cpu", "cpu"]


def test_cuda_ipc_refuses_a_host_payload():
    with pytest.raises(TransportError, match="encoded on a GPU"):
        CudaIpcTransport().offer(b"bytes")
    with pytest.raises(TransportError, match="encoded on a GPU"):
        CudaIpcTransport().offer(codec.encode_wire(_codes(), "base:qa", "v3", DIMS, "int8"))
