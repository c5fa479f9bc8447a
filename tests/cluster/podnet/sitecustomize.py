"""TEST-ONLY, on the PYTHONPATH of every pod the node runner starts. In a cluster each pod has a network namespace
of its own, where listening on every address (0.0.0.0, ::) means on the pod's IP; here all pods share this
machine's, so a process listening on every address would take its port from every other pod (an operator's
0.0.0.0:8080 from each router's 127.0.x.y:8080). A wildcard bind is narrowed to the pod's IP instead."""
import os
import socket

_ip = os.environ.get("NODERUNNER_POD_IP")
_bind = socket.socket.bind


def _pod_bind(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] in ("", "0.0.0.0", "::"):
        # An IPv6 socket takes the IPv4 address mapped (dual-stack, as Linux makes them by default).
        address = (_ip if self.family == socket.AF_INET else f"::ffff:{_ip}", *address[1:])
    return _bind(self, address)


if _ip:
    socket.socket.bind = _pod_bind
