"""The user-space switch: one TUN device per emulated host, packets delayed and paced by a LinkModel.

Run as its own process (`python -m corolla.netemu.switch CONFIG_JSON`, started by EmulatedNetwork): it creates the
TUN devices (non-persistent, so they vanish when this process exits), prints one line `{"ready": ...}` on stdout,
and then forwards IPv4 packets between the devices. Packets wait in a heap until their release time and are
written out when a `select()` timer says they are due. Packets to addresses it does not know are dropped: the
switch never forwards anything to a real interface.

Control: one JSON object per line on stdin, one JSON reply per line on stdout.
    {"op": "set_link", "host": "a", "up": false}             any of up, delay (s), rate (bytes/s or null),
                                                              accept_inbound
    {"op": "set_pair_delay", "a": "a", "b": "b", "delay": 0.01}   one-way seconds; null removes the override
    {"op": "stats"}                                           packets forwarded and dropped per host
End of stdin (the parent is gone) stops the switch, and so does `max_seconds` (default a day) in the config.
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import json
import os
import select
import struct
import sys
import time
from dataclasses import dataclass

from corolla.netemu.links import Link, LinkModel, parse_ipv4

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536 + 64
MAX_READS_PER_DEVICE = 64  # packets read from one device per loop turn, so that no device starves the others


@dataclass
class Device:
    host: str
    address: str
    fd: int
    forwarded: int = 0
    dropped: int = 0


def open_tun(name: str) -> int:
    """Create TUN device `name` (IFF_NO_PI: reads and writes are bare IP packets) and return its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Switch:
    def __init__(self, config: dict):
        self.model = LinkModel(
            {
                h["name"]: Link(
                    delay=h.get("delay", 0.0), rate=h.get("rate"), accept_inbound=h.get("accept_inbound", True)
                )
                for h in config["hosts"]
            },
            queue_limit=config.get("queue_limit", 0.5),
        )
        self.devices: dict[str, Device] = {}
        for host in config["hosts"]:
            self.devices[host["name"]] = Device(host["name"], host["address"], open_tun(host["device"]))
        self.by_address = {d.address: d for d in self.devices.values()}
        self.by_fd = {d.fd: d for d in self.devices.values()}
        self.deadline = time.monotonic() + float(config.get("max_seconds", 86400.0))
        self.heap: list[tuple[float, int, int, bytes]] = []  # (release time, tiebreak, destination fd, packet)
        self.counter = itertools.count()

    def run(self) -> None:
        control = sys.stdin.fileno()
        print(json.dumps({"ready": {h: d.address for h, d in self.devices.items()}}), flush=True)
        buffered = b""
        while time.monotonic() < self.deadline:
            timeout = min(self.heap[0][0] if self.heap else self.deadline, self.deadline) - time.monotonic()
            timeout = max(0.0, timeout)
            readable, _, _ = select.select([control, *self.by_fd], [], [], timeout)
            for fd in readable:
                if fd == control:
                    chunk = os.read(control, 65536)
                    if not chunk:
                        return
                    buffered += chunk
                    while b"\n" in buffered:
                        line, buffered = buffered.split(b"\n", 1)
                        if line.strip():
                            print(json.dumps(self.control_line(line)), flush=True)
                else:
                    self.receive(self.by_fd[fd])
            self.release(time.monotonic())

    def receive(self, device: Device) -> None:
        for _ in range(MAX_READS_PER_DEVICE):
            try:
                data = os.read(device.fd, MAX_PACKET)
            except BlockingIOError:
                return
            packet = parse_ipv4(data)
            target = self.by_address.get(packet.dst) if packet is not None else None
            if packet is None or target is None or packet.src != device.address:
                device.dropped += 1
                continue
            now = time.monotonic()
            due = self.model.schedule(now, device.host, target.host, packet.size, packet.opens_connection)
            if due is None:
                device.dropped += 1
                continue
            heapq.heappush(self.heap, (due, next(self.counter), target.fd, data))

    def release(self, now: float) -> None:
        while self.heap and self.heap[0][0] <= now:
            _, _, fd, data = heapq.heappop(self.heap)
            device = self.by_fd[fd]
            try:
                os.write(fd, data)
                device.forwarded += 1
            except OSError:  # device down or its queue full: the packet is lost, as on a real link
                device.dropped += 1

    def control_line(self, line: bytes) -> dict:
        try:
            message = json.loads(line)
        except ValueError as e:
            return {"ok": False, "error": f"not JSON: {e}"}
        return self.command(message) if isinstance(message, dict) else {"ok": False, "error": "not an object"}

    def command(self, message: dict) -> dict:
        try:
            op = message["op"]
            if op == "set_link":
                link = self.model.links[message["host"]]
                for key in ("up", "delay", "rate", "accept_inbound"):
                    if key in message:
                        setattr(link, key, message[key])
                return {"ok": True}
            if op == "set_pair_delay":
                pair = frozenset((message["a"], message["b"]))
                if message.get("delay") is None:
                    self.model.pair_delay.pop(pair, None)
                else:
                    self.model.pair_delay[pair] = float(message["delay"])
                return {"ok": True}
            if op == "stats":
                return {
                    "ok": True,
                    "stats": {h: {"forwarded": d.forwarded, "dropped": d.dropped} for h, d in self.devices.items()},
                }
            return {"ok": False, "error": f"unknown op {op!r}"}
        except (KeyError, TypeError, ValueError) as e:
            return {"ok": False, "error": repr(e)}


def main() -> None:
    Switch(json.loads(sys.argv[1])).run()


if __name__ == "__main__":
    main()
