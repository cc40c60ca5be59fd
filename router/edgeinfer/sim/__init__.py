"""Discrete-event simulation of an edgeinfer deployment: many PoPs, one process.

Clients arrive by region over the day, the network costs great-circle RTT plus jitter, every
daemon is an engine whose step time comes from a measured profile (``profile``), and placement
is decided by the router's own ``selector.select`` fed by real heartbeats through a real
``PopRegistry`` (``policies``), or by a baseline. ``simulator`` runs the events, ``metrics``
turns the requests into TTFT/ITL/goodput and utilisation, ``plots`` draws them and ``planner``
searches prefill:decode splits. Prefix-sharing traces (Mooncake format) give every daemon a
prefix cache (``prefix_cache``) and add the policies that use it (``prefix_policies``). See
docs/SIMULATION.md for the model and where it is approximate.
"""

from edgeinfer.shared.errors import EdgeInferError


class SimError(EdgeInferError):
    """A simulation input is invalid: unreadable profile or trace, impossible topology, bad mix."""
