"""This machine's address that the other machines of a job reach: the main address of a many-machine run.

    python -m hftrain.hostaddr [IFNAME]      prints it (exit 2 and one line on stderr when there is none)

The SLURM script (hftrain/launch/slurm.py) runs it on the allocation's first node, which hosts global rank 0. With
an interface (strategy.socket_ifname) it is that interface's IPv4 address; without, the addresses the hostname
resolves to, loopback refused: on many machines the hostname resolves to 127.0.0.1 or 127.0.1.1 (Debian's
/etc/hosts), which the other nodes cannot reach, and the job would hang at the rendezvous. Standard library only (it
runs in the job's script before anything else; importing torch here would cost seconds).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import sys

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of interface `ifname` on this machine (Linux), None when it has none or does not exist."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _resolved(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def reachable_address(ifname: str | None = None) -> str:
    """The address other machines reach this one on; ValueError naming what to set when there is none."""
    host = socket.gethostname()
    names = ", ".join(interface_names()) or "none found"
    if ifname:
        addr = interface_address(ifname)
        if addr is None:
            raise ValueError(f"strategy.socket_ifname: {host} has no IPv4 address on interface {ifname!r} "
                             f"(interfaces here: {names}); name the interface the machines reach each other on")
        return addr
    addrs = _resolved(host)
    usable = [a for a in addrs if not ipaddress.ip_address(a).is_loopback]
    if not usable:
        raise ValueError(f"the hostname {host} resolves to {', '.join(addrs) or 'nothing'}, which the other machines "
                         "cannot reach; set strategy.socket_ifname to the interface they reach this one on "
                         f"(interfaces here: {names})")
    return usable[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        print(reachable_address(argv[0] if argv else None))
    except ValueError as e:
        print(f"hftrain: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
