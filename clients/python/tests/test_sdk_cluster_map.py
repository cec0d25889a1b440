"""The sans-IO cluster map both clients route by: revisions, node backoff, choices.

These decisions involve no I/O (the cluster tests, test_sdk_cluster*.py, run them
against real nodes); here each rule is pinned on its own with ClusterInfo messages.
"""

from __future__ import annotations

import logging
import time

import pytest

from querator._cluster import ABANDONED, DOWN_CAP, DOWN_FIRST, LEFT, UNSENT, ClusterMap, Route, never_sent, node_gone, tagged
from querator._config import ClientConfig
from querator._streams import from_stream_error
from querator._transport import AsyncTransport
from querator.errors import Unavailable
from querator.v1 import cluster_pb2, queue_pb2


def _info(revision: int, homes: list[str], live: tuple[str, ...] = ("n1", "n2", "n3")) -> cluster_pb2.ClusterInfoResponse:
    return cluster_pb2.ClusterInfoResponse(
        clustered=True,
        revision=revision,
        members=[cluster_pb2.ClusterMember(node_id=n, address=f"h{n[1]}:1", live=n in live) for n in ("n1", "n2", "n3")],
        queues=[cluster_pb2.QueuePlacement(queue_name="q", homes=homes)],
    )


def test_an_older_view_never_replaces_a_newer_one() -> None:
    m = ClusterMap(30)
    m.apply(_info(5, ["n1", "n2"]), None, 0)
    m.apply(_info(4, ["n3", "n3"]), None, 1)
    assert m.homes("q") == ["n1", "n2"] and m.revision == 5
    m.apply(_info(6, ["n3", "n2"]), None, 2)
    assert m.homes("q") == ["n3", "n2"]


def test_a_single_server_is_asked_once() -> None:
    m = ClusterMap(30)
    assert m.needs_info(0)
    m.apply(cluster_pb2.ClusterInfoResponse(clustered=False), None, 0)
    assert not m.needs_info(1e9) and not m.needs_lookup("q", 1e9)


def test_a_node_down_is_skipped_with_bounded_doubling_backoff_and_logged_per_transition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="querator.cluster")
    m = ClusterMap(30)
    m.apply(_info(1, ["n1", "n2"]), None, 0)
    now, delays = 0.0, []
    for _ in range(8):
        m.mark_down("n1", now, "refused")
        delay = m._down["n1"].delay
        delays.append(delay)
        assert m.is_down("n1", now) and m.produce_node("q", now) == "n2"
        now += delay
    assert delays[0] == DOWN_FIRST and delays[1] == 2 * DOWN_FIRST and max(delays) == DOWN_CAP
    m.mark_up("n1")
    m.mark_up("n1")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("is down" in t for t in messages) == 1 and sum("answers again" in t for t in messages) == 1


def test_produce_prefers_the_emptier_node_and_lease_the_one_with_ready_items() -> None:
    m = ClusterMap(30)
    m.apply(_info(1, ["n1", "n1", "n2", "n2"]), None, 0)
    m.apply_stats("q", [(0, 500), (1, 500), (2, 0), (3, 0)])
    picks = [m.produce_node("q", 0, rnd=k / 100) for k in range(100)]
    assert picks.count("n2") > 95
    assert {m.lease_node("q", 0, rnd=k / 10) for k in range(10)} == {"n1"}


def test_lease_moves_on_when_a_node_answers_empty() -> None:
    m = ClusterMap(30)
    m.apply(_info(1, ["n1", "n2", "n3"]), None, 0)
    m.apply_stats("q", [])
    seen = []
    for _ in range(3):
        node = m.lease_node("q", 0)
        seen.append(node)
        m.leased("q", node, 0)
    assert sorted(seen) == ["n1", "n2", "n3"]


def test_a_dead_member_is_not_routed_to() -> None:
    m = ClusterMap(30)
    m.apply(_info(1, ["n1", "n2"], live=("n2",)), None, 0)
    assert {m.produce_node("q", 0) for _ in range(20)} == {"n2"}


def test_a_node_that_answers_unavailable_about_a_queue_is_left_out_of_it_alone() -> None:
    m = ClusterMap(30)
    m.apply(_info(1, ["n1", "n2"]), None, 0)
    m.mark_queue_down("q", "n1", 0)
    assert {m.produce_node("q", 0.1) for _ in range(20)} == {"n2"}
    assert not m.is_down("n1", 0.1)  # the node still serves its other queues
    assert {m.produce_node("q", DOWN_FIRST + 0.1, rnd=k / 10) for k in range(10)} == {"n1", "n2"}
    m.mark_queue_down("q", "n2", 0)
    m.mark_queue_down("q", "n1", 0)
    assert m.produce_node("q", 0.1) in {"n1", "n2"}  # never every node left out


def test_what_a_stream_failure_says_about_its_node_and_its_request() -> None:
    """The streams tag the failures no gRPC text describes; the others are read as text."""

    def unavailable(message: str, origin: str = "") -> Unavailable:
        error = Unavailable(message)
        return tagged(error, origin) if origin else error

    refused = unavailable("failed to connect to all addresses; last error: Connection refused")
    cut = unavailable("Stream removed (Socket closed)")
    assert (node_gone(refused), never_sent(refused)) == (True, True)
    assert (node_gone(cut), never_sent(cut)) == (True, False)  # in flight: outcome unknown
    assert (node_gone(unavailable("x", UNSENT)), never_sent(unavailable("x", UNSENT))) == (True, True)
    assert (node_gone(unavailable("x", LEFT)), never_sent(unavailable("x", LEFT))) == (True, False)
    abandoned = unavailable("closed to take back an abandoned request; socket closed", ABANDONED)
    assert (node_gone(abandoned), never_sent(abandoned)) == (False, False)
    # A status a node answered on a stream reads as the same status of a unary call.
    answered = from_stream_error(queue_pb2.StreamError(code=14, message="the server is shutting down"))
    assert node_gone(answered) and not never_sent(answered)

    # A stream this process closed marks neither the node nor the queue down.
    transport = AsyncTransport(ClientConfig())
    transport.cluster.apply(_info(1, ["n1", "n2"]), None, 0)
    route = Route("n1", "h1:1", "q", "lease")
    assert not transport._node_failed(route, abandoned)
    now = time.monotonic()
    assert {transport.cluster.produce_node("q", now, rnd=k / 10) for k in range(10)} == {"n1", "n2"}
    assert not transport.cluster.is_down("n1", now)
    assert transport._node_failed(route, cut) and transport.cluster.is_down("n1", time.monotonic())
