"""Decode role: pull a prompt's KV from the prefill engine the router named (the KV hand-off over HTTP).

The peer URL comes in a request header, so it is a server-side request on someone's behalf: it is honoured only
for holders of the internal token (the router), only toward a plain `http://IP:port` that is not a link-local,
multicast or unspecified address (nor loopback, unless this engine itself listens there), with short timeouts and
a reply no larger than the KV can be; the reply counts only with the peer's MAC by the same token, and a peer's
body is never echoed."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import urllib.parse

import httpx

from slofleet.api.contract import KV_MAC_HEADER

from ..errors import InvalidRequest, UpstreamError
from ..kv_transfer import KVPayload
from ..sampling_params import SamplingParams
from .http import ApiError

TIMEOUT = httpx.Timeout(connect=3.0, read=300.0, write=10.0, pool=3.0)  # a long prompt's prefill may queue


def mac(token: str, payload: bytes) -> str:
    return hmac.new(token.encode(), payload, hashlib.sha256).hexdigest()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def peer_base(url: str, allow_loopback: bool) -> str:
    """The peer's base URL, or InvalidRequest saying why it may not be called."""
    parts = urllib.parse.urlsplit(url)
    try:
        ip = ipaddress.ip_address((parts.hostname or "").strip("[]"))
        port = parts.port
    except ValueError:
        raise InvalidRequest("the prefill URL must be http://IP:PORT of a prefill engine") from None
    bad = (parts.scheme != "http" or parts.username or parts.password or parts.path not in ("", "/")
           or parts.query or parts.fragment or port is None
           or ip.is_link_local or ip.is_multicast or ip.is_unspecified or (ip.is_loopback and not allow_loopback))
    if bad:
        raise InvalidRequest("the prefill URL must be http://IP:PORT of a prefill engine")
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"http://{host}:{port}"


def peer_message(status: int, body: bytes) -> str:
    """What a peer engine said, from its OpenAI-shaped error only: never echo a body we did not expect."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


async def fetch_kv(base: str, ids: list[int], params: SamplingParams, token: str, limit: int,
                   headers: dict[str, str]) -> KVPayload:
    """POST the prompt to the peer and read back at most `limit` bytes of KV, authenticated by `token`; `headers`
    carry the request's trace context and id."""
    body = {"prompt_token_ids": ids, "sampling": dataclasses.asdict(params)}
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=False) as client:
            async with client.stream("POST", base + "/v1/kv/prefill", json=body,
                                     headers={**headers, "authorization": f"Bearer {token}"}) as r:
                data = bytearray()
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise UpstreamError(f"prefill engine {base}: the reply exceeds {limit} bytes")
    except httpx.HTTPError as e:
        raise UpstreamError(f"prefill engine {base} unreachable: {type(e).__name__}") from None
    if r.status_code != 200:
        if r.status_code < 500:  # the prefill engine refused the request itself (e.g. 429): pass it on
            raise ApiError(r.status_code, f"prefill engine: {peer_message(r.status_code, data)}", "upstream_error",
                           headers={k: v for k, v in r.headers.items() if k.lower() == "retry-after"} or None)
        raise UpstreamError(f"prefill engine {base}: {peer_message(r.status_code, data)}")
    if not hmac.compare_digest(r.headers.get(KV_MAC_HEADER, ""), mac(token, bytes(data))):
        raise UpstreamError(f"prefill engine {base}: the reply is not signed by this service's token")
    return KVPayload.from_bytes(bytes(data))
