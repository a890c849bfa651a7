"""Transports on a real local Ray: object store, and the NCCL protocol over a fake communicator."""
import ray

from actors.transport import (FakeNcclHub, NcclTransport, ObjectStoreTransport, Ticket, TransportError,
                              fake_nccl)


def test_object_store_round_trip_across_processes(ray_cluster):
    t = ObjectStoreTransport()
    ticket = t.send(b"\x00codes" * 1000)

    @ray.remote(num_cpus=0)
    def replica(tk):
        return ObjectStoreTransport().recv(tk)

    assert ray.get(replica.remote(ticket)) == b"\x00codes" * 1000
    bad = Ticket("object_store", 5, ref=ticket.ref)
    try:
        t.recv(bad)
        raise AssertionError("a size mismatch must be refused")
    except TransportError as e:
        assert "ticket says 5" in str(e)


@ray.remote(num_cpus=0)
class Replica:
    """A specialist replica's side of the NCCL protocol, in its own process."""

    def __init__(self, hub, rid):
        self.t, self.rid = NcclTransport(*fake_nccl(hub)), rid

    def join(self, uid):
        self.t.join(self.rid, uid)

    def recv(self, ticket):
        return self.t.recv(ticket)


def test_nccl_protocol_register_send_recv_leave_with_a_fake_communicator(ray_cluster):
    hub = FakeNcclHub.remote()
    producer = NcclTransport(*fake_nccl(hub))
    replicas = {rid: Replica.remote(hub, rid) for rid in ("qa#1", "qa#2")}
    for rid, r in replicas.items():                  # replica registration: rank 0 here, rank 1 there
        uid = producer.open_for(rid)
        ray.get(r.join.remote(uid))
    assert ray.get(hub.open_communicators.remote()) == 2
    for i in range(3):                               # in-order delivery per communicator
        for rid, r in replicas.items():
            payload = f"{rid}-{i}".encode() * 50
            assert ray.get(r.recv.remote(producer.send(payload, rid))) == payload
    producer.close_for("qa#2")                       # scale-down: the communicator goes away
    try:
        producer.send(b"x", "qa#2")
        raise AssertionError("sending to a departed replica must fail")
    except TransportError as e:
        assert "qa#2" in str(e)
    assert ray.get(hub.open_communicators.remote()) == 1
    # a ticket out of sequence is refused, not silently mis-delivered
    producer.send(b"first", "qa#1")
    t2 = producer.send(b"second", "qa#1")
    try:
        ray.get(replicas["qa#1"].recv.remote(t2))
        raise AssertionError("out-of-order ticket must be refused")
    except ray.exceptions.RayTaskError as e:
        assert "out of order" in str(e)
