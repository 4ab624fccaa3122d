"""The learner's weight data plane, least privilege: its store listens on one interface (the one generators
reach, not every one), and it sends its API token only to generators whose registered URL's host is allowed -
a stand-in generator outside ``allowed_generator_hosts`` records every request it gets, and gets none."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from shared.allowed_hosts import HostAllowList, parse_entry
from shared.config.learner import LearnerSettings
from shared.records import GeneratorRegistration
from weight_sync.sender import WeightPusher

TOKEN = "a-learner-api-token-of-32-characters!"


class _Recorder(BaseHTTPRequestHandler):
    """Answers 200 to anything and records (method, path, Authorization) of every request."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.requests.append((self.command, self.path, self.headers.get("Authorization")))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stand_in():
    """A stand-in generator on 127.0.0.1 that records every request; yields its server (``.requests``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_a_generator_registered_outside_the_allowed_hosts_is_refused_and_never_contacted(stand_in, caplog):
    port = stand_in.server_address[1]
    outsider = GeneratorRegistration(generator_id="gen-x", url=f"http://127.0.0.1:{port}", policy_version=0)
    by_name = GeneratorRegistration(generator_id="gen-y", url=f"http://localhost:{port}", policy_version=0)
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN, allowed_hosts=["10.244.0.0/16"])
    caplog.set_level(logging.ERROR)
    named = [("w", torch.zeros(4))]
    async with httpx.AsyncClient() as http:
        for version in (1, 2):
            report = await pusher.push(named, version, [outsider, by_name], http)
            assert report.generators == () and report.bytes == 0
    assert stand_in.requests == []  # not a health check, not a POST: the token never left
    assert pusher.refused_by_host == 2 and pusher.allowed([outsider, by_name]) == []
    refusals = [r.getMessage() for r in caplog.records if "refusing generator" in r.getMessage()]
    assert len(refusals) == 2 and "allowed_generator_hosts" in refusals[0]  # once per URL, with the fix
    assert TOKEN not in caplog.text

    # The same stand-in, allowed: the learner does contact it (the recorder records what it is sent).
    allowed = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN, allowed_hosts=["127.0.0.0/8"])
    async with httpx.AsyncClient() as http:
        assert await allowed._answering(allowed.allowed([outsider, by_name]), http) == [outsider]
    assert stand_in.requests == [("GET", "/health", None)]


def test_allow_list_entries_match_addresses_networks_and_listed_names_only():
    allowed = HostAllowList(["127.0.0.1", "::1", "localhost", "10.244.0.0/16", "gen-0.example."])
    for url in ("http://127.0.0.1:8001", "http://[::1]:8001", "http://LOCALHOST:1", "https://10.244.3.4/x",
                "http://gen-0.example:8001"):  # fmt: skip
        assert allowed.allows(url), url
    for url in ("http://127.0.0.2:8001", "http://10.245.0.1:8001", "http://gen-1.example:8001",
                "http://evil.example/?x=127.0.0.1", "http://127.0.0.1@evil.example:8001", "ftp://127.0.0.1/",
                "http://[::1:8001", "http://:8001", "not a url"):  # fmt: skip
        assert not allowed.allows(url), url
    with pytest.raises(ValueError, match="neither an IP address"):
        parse_entry("gen 0")
    with pytest.raises(ValueError, match="allowed_generator_hosts"):
        LearnerSettings(model="/m", allowed_generator_hosts=["10.0.0.0/8", "*.example"])
    assert LearnerSettings(model="/m").allowed_generator_hosts == ["127.0.0.1", "::1", "localhost"]


def _listening(port: int) -> set[str]:
    """IPv4 addresses a TCP socket of this machine listens on at ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_the_weight_store_listens_on_the_address_generators_reach_not_every_interface():
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN)
    assert _listening(pusher.port) == {"127.0.0.1"}  # weight_sync_bind unset: the advertised address
    client = torch.distributed.TCPStore(
        "127.0.0.1", pusher.port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    client.set("from-a-generator", "hello")
    assert pusher.store.get("from-a-generator") == b"hello"
    everywhere = WeightPusher(bind_port=0, advertise_host="127.0.0.1", bind_host="0.0.0.0", api_token=TOKEN)
    assert _listening(everywhere.port) == {"0.0.0.0"}  # only when asked
    with pytest.raises(OSError, match=r"set learner\.weight_sync_bind to an address of this machine"):
        WeightPusher(bind_port=0, advertise_host="192.0.2.1", api_token=TOKEN)  # TEST-NET-1: not ours
