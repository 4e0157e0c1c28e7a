"""The network settings of a many-machine run, in one place: what the recipe's `strategy.socket_ifname` sets for the
communication libraries (NCCL on GPUs, gloo on CPUs). The run's set-up exports them (before the process group starts)
and the SLURM script writes the same lines (hftrain/launch/slurm.py).

Why: without them both libraries bind the address the hostname resolves to, which on many machines is 127.0.0.1: the
other machines' ranks then fail to connect, or wait (../shared/FEASIBILITY.md, two hosts on one machine).
"""

from __future__ import annotations

import os

from ..config import StrategySection
from ..distributed import print0
from ..errors import LaunchError
from ..hostaddr import interface_names

SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def socket_environment(strategy: StrategySection) -> dict[str, str]:
    """{variable: interface} for strategy.socket_ifname ({} when unset)."""
    return {k: strategy.socket_ifname for k in SOCKET_VARIABLES} if strategy.socket_ifname else {}


def export_socket_environment(strategy: StrategySection) -> None:
    """Export socket_environment into this process (a rank, before its process group starts). The interface must
    exist on this machine; a variable already set to another interface is replaced, and said."""
    env = socket_environment(strategy)
    if not env:
        return
    names = interface_names()
    if names and strategy.socket_ifname not in names:
        raise LaunchError(f"strategy.socket_ifname: this machine has no interface {strategy.socket_ifname!r} "
                          f"(it has {', '.join(names)}); name the interface the machines reach each other on")
    for key, value in env.items():
        if os.environ.get(key, value) != value:
            print0(f"hftrain: {key} was {os.environ[key]!r}; strategy.socket_ifname sets it to {value!r}")
        os.environ[key] = value
