"""The test harness's ``mongod`` replica set survives a port taken between its choice and
the node's bind: CI's short chaos profile (2026-12-06) failed on "Address already in use"
while other tests started servers beside it. A node that lost its port is started again on
another, before the set's hosts are fixed."""

from __future__ import annotations

import socket

from tests.support.mongod import MongodReplicaSet


def test_a_node_whose_port_was_taken_starts_on_another() -> None:
    replset = MongodReplicaSet(1)
    node = replset.nodes[0]
    taken = node.port
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen(1)
    try:
        replset.start()
        try:
            assert node.port != taken and node.alive()
            with node.client(serverSelectionTimeoutMS=5000) as client:
                assert client.admin.command("ping")["ok"] == 1
        finally:
            replset.stop()
    finally:
        squatter.close()
