"""Transports on a real local Ray, through the one interface the producer and the replicas call: the object
store, and NIXL through Ray Direct Transport (on CPU, over UCX; cuda_ipc and device memory: tests/test_gpu.py)."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from actors.transport import INLINE_BYTES, CudaIpcTransport, Ticket, TransportError, make_transport, warm
from scd.online import codec
from tests.test_codec import DIMS, PLAN, _codes




@ray.remote(num_cpus=0, max_concurrency=8)
class Producer:
    """The producer actor's transport calls (offer, and the pulls Ray Direct Transport serves), around any
    Transport."""

    def __init__(self, kind, inline_bytes=0):            # 0: every payload by the transport itself
        self.t = make_transport(kind, inline_bytes=inline_bytes)

    def offer(self, payload, receivers=1):
        return self.t.offer(payload, receivers)

    def staged(self):
        return self.t.staged(), self.t.stage.nbytes

    def offer_codes(self, receivers=1, device="cpu"):
        """A device payload of a small set of codes, encoded here (on `device`); returns (ticket, its bytes)."""
        wire = codec.encode_wire(_codes().to(device), "base:qa", "v3", DIMS, "int8")
        assert wire.body.device.type == device
        return self.t.offer(wire, receivers), wire.head, wire.body.cpu().numpy().tobytes()

    @ray.method(tensor_transport="nixl")
    def pull(self, key):
        return self.t.take(key)

    @ray.method(tensor_transport="cuda_ipc")
    def pull_ipc(self, key):
        return self.t.take(key)


@ray.remote(num_cpus=0, max_concurrency=8)
class Replica:
    """A specialist replica's end of the transport, in its own process, not told which transport it is."""

    def __init__(self, kind, producer, timeout_s=120.0):    # only a failure waits this long
        self.r = make_transport(kind).receiver(lambda name: producer, timeout_s)

    def receive(self, ticket):
        return self.r.receive(ticket)

    def decode(self, ticket):
        """Receive a device payload and decode it where it arrived: (its body's device, head, body bytes, ids)."""
        wire = self.r.receive(ticket)
        codes = codec.decode(wire, "base:qa", "v3", PLAN, DIMS)
        return str(wire.body.device), wire.head, wire.body.cpu().numpy().tobytes(), codes.token_ids.cpu()

    def receive_many(self, tickets):
        with ThreadPoolExecutor(len(tickets)) as pool:
            return list(pool.map(self.r.receive, tickets))


def test_object_store_round_trip_across_processes(ray_cluster):
    """A small payload travels in its ticket (no put, no borrowed reference); a large one is put once, and the
    same payload offered again (a cached prefix's) is the same object. Either way a ticket whose size
    disagrees with what arrives is refused."""
    producer = Producer.remote("object_store", INLINE_BYTES)
    replica = Replica.remote("object_store", producer)
    small, large = b"\x00codes" * 1000, bytes(range(256)) * (INLINE_BYTES // 256 + 1)
    ticket = ray.get(producer.offer.remote(small))
    assert ticket.data == small and ticket.ref is None, "a payload under INLINE_BYTES rides in its ticket"
    assert ray.get(replica.receive.remote(ticket)) == small
    ticket = ray.get(producer.offer.remote(large))
    assert ticket.data is None and ticket.ref, "a large payload goes to the object store"
    assert ray.get(replica.receive.remote(ticket)) == large
    for bad in (Ticket("object_store", 5, ref=ticket.ref), Ticket("object_store", 5, data=small)):
        with pytest.raises(ray.exceptions.RayTaskError, match="ticket says 5"):
            ray.get(replica.receive.remote(bad))


def test_object_store_puts_a_cached_payload_once(monkeypatch):
    """The producer offers a cached prefix's payload (the same bytes object) again: one put, the same ref."""
    from actors.transport import ObjectStoreTransport
    t = ObjectStoreTransport()
    payload = b"x" * (INLINE_BYTES + 1)
    puts = []
    monkeypatch.setattr(ray, "put", lambda x: puts.append(x) or f"ref{len(puts)}")
    first, again = t.offer(payload, 2), t.offer(payload)
    assert len(puts) == 1 and first.ref == again.ref == ["ref1"]


def _wire(i: int, n: int) -> codec.Wire:
    return codec.Wire(f"head {i}".encode(), torch.full((n,), i, dtype=torch.uint8))


def test_nixl_replicas_pull_their_payloads_and_a_family_payload_is_staged_once(ray_cluster):
    """Two replicas, each in its own process, pull payloads through Ray Direct Transport (NIXL on CPU): header
    and body intact, concurrently; a payload offered for three receivers stays staged until the third pull; a
    key no longer staged is a TransportError (the request falls back), not a hang; bytes are refused (an RDT
    transport moves tensors: the producer encodes `codec.Wire`s for it)."""
    p = Producer.remote("nixl")
    a, b = Replica.remote("nixl", p), Replica.remote("nixl", p)
    for round in range(4):              # four pulls at once in each replica: one process's pulls must not race
        payloads = [_wire(i, 1000 + 37 * i + round) for i in range(8)]
        tickets = [ray.get(p.offer.remote(x)) for x in payloads]
        assert {t.kind for t in tickets} == {"nixl"}
        assert ray.get(p.staged.remote()) == (8, sum(map(len, payloads)))
        got = ray.get([a.receive_many.remote(tickets[:4]), b.receive_many.remote(tickets[4:])])
        for n, (w, x) in enumerate(zip(got[0] + got[1], payloads)):
            assert (w.head, w.body.numpy().tobytes()) == (x.head, x.body.numpy().tobytes()), (
                f"round {round}, payload {n}: got {w.head!r} with {len(w)} bytes, values "
                f"{sorted(set(w.body.tolist()))[:8]}; sent {x.head!r} with {len(x)}")
        assert ray.get(p.staged.remote()) == (0, 0), "every pulled payload is released"
    family = ray.get(p.offer.remote(_wire(7, 5000), 3))
    for r in (a, b):
        assert ray.get(r.receive.remote(family)).body.numpy().tobytes() == bytes([7]) * 5000
    assert ray.get(p.staged.remote()) == (1, 5000 + len(b"head 7")), "staged until its third receiver pulls"
    ray.get(a.receive.remote(family))
    assert ray.get(p.staged.remote()) == (0, 0)
    with pytest.raises(TransportError, match="no staged payload"):
        ray.get(a.receive.remote(family))
    with pytest.raises(TransportError, match="cannot read"):
        ray.get(a.receive.remote(Ticket("object_store", 3)))
    with pytest.raises(TransportError, match="tensors"):
        ray.get(p.offer.remote(b"bytes"))


@ray.remote(num_cpus=0)
class Warmed:
    """A process started as the producer and the replicas start: its transport warmed, nothing pulled yet."""

    def __init__(self, kind):
        warm(kind)

    def has_nixl_agent(self) -> bool:
        from ray.experimental.rdt import util
        manager = util.transport_managers.get("NIXL")
        return manager is not None and manager._nixl_agent is not None


def test_a_nixl_process_has_its_agent_before_its_first_pull(ray_cluster):
    """Warmed, a nixl producer or replica has built its NIXL agent at start (its first pull would otherwise
    build it inside the pull's timeout); an object-store one has none."""
    assert ray.get(Warmed.remote("nixl").has_nixl_agent.remote()) is True
    assert ray.get(Warmed.remote("object_store").has_nixl_agent.remote()) is False


def test_a_nixl_agent_that_cannot_start_is_left_to_the_first_pull(monkeypatch, caplog):
    """warm() never stops a process from starting: the failure is logged and the first pull falls back."""
    from ray.experimental.rdt import util

    def broken(name):
        raise RuntimeError("no UCX here")
    monkeypatch.setattr(util, "get_tensor_transport_manager", broken)
    warm("nixl")
    assert "no UCX here" in caplog.text, caplog.text


def pull_device_payloads(kind: str, device: str) -> list:
    """A device payload encoded in the producer on `device`, pulled by two replicas (a family's one payload for
    both) and decoded where it arrived; returns where each body arrived. Shared with the GPU tests."""
    gpus = 0.25 if device == "cuda" else 0                 # all on one GPU (cuda_ipc needs that; nixl does not)
    p = Producer.options(num_gpus=gpus).remote(kind)
    a, b = (Replica.options(num_gpus=gpus).remote(kind, p) for _ in range(2))
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


def test_a_small_device_payload_rides_in_its_nixl_ticket_and_decodes_without_a_pull():
    """A Wire of at most inline_bytes is not staged: the ticket carries its header and its body as host bytes,
    the receiver rebuilds the Wire without calling the producer, and it decodes to the encoded codes (the
    device checksum, sum64, holds on the host copy). One byte over the limit is staged for a pull."""
    wire = codec.encode_wire(_codes(), "base:qa", "v3", DIMS, "int8")
    t = make_transport("nixl", owner="scd-producer-0", inline_bytes=len(wire))
    ticket = t.offer(wire, receivers=2)
    assert ticket.data is not None and ticket.key is None and t.staged() == 0, ticket
    assert ticket.producer == "scd-producer-0" and ticket.nbytes == len(wire)

    def no_pulls(name):
        raise AssertionError(f"the receiver called producer {name!r} for a payload its ticket carries")
    got = t.receiver(no_pulls).receive(ticket)
    assert got.head == wire.head and torch.equal(got.body, wire.body)
    codes = codec.decode(got, "base:qa", "v3", PLAN, DIMS)
    assert torch.equal(codes.token_ids, _codes().token_ids)
    with pytest.raises(TransportError, match="says 1"):
        t.receiver(no_pulls).receive(Ticket("nixl", 1, data=ticket.data, head=ticket.head))
    over = make_transport("nixl", inline_bytes=len(wire) - 1).offer(wire)
    assert over.data is None and over.key, "a payload over inline_bytes is staged for a pull"
