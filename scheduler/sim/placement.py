"""Device placement for the baselines: a per-pass working copy of which devices are free.

Meridian does not use this module; it places through the scheduler core.
"""
from __future__ import annotations

import numpy as np


class Workspace:
    """A scratch copy of the free devices that a policy takes from and gives back to while
    it plans one pass; the engine's own state changes only when the decisions are applied."""

    def __init__(self, engine):
        self.engine = engine
        self.dev_free = engine.dev_free_mask()
        self.node_free = engine.node_free.copy()
        self.node_first = engine.node_first
        self.node_devices = engine.fleet.node_devices
        self.dev_node = engine.dev_node
        self.max_node = int(self.node_devices.max())
        self.free_total = int(self.node_free.sum())

    def take(self, devices):
        self.dev_free[devices] = False
        np.subtract.at(self.node_free, self.dev_node[devices], 1)
        self.free_total -= len(devices)

    def give(self, devices):
        """Returns devices to the pool (a job this pass preempts or moves); devices on a failed
        node stay unusable."""
        healthy = self.engine.node_healthy[self.dev_node[devices]]
        devices = devices[healthy]
        self.dev_free[devices] = True
        np.add.at(self.node_free, self.dev_node[devices], 1)
        self.free_total += len(devices)

    def free_on_node(self, node, count):
        first = self.node_first[node]
        local = np.flatnonzero(self.dev_free[first:first + self.node_devices[node]])
        return local[:count] + first

    def find(self, need):
        """Returns `need` free devices, consolidated: the fullest node that still fits them
        (best fit); else the fewest nodes, fullest-free first. Returns None when fewer than
        `need` devices are free."""
        if need > self.free_total:
            return None
        if need <= self.max_node:
            fits = np.flatnonzero(self.node_free >= need)
            if fits.size:
                node = fits[np.argmin(self.node_free[fits])]
                return self.free_on_node(node, need)
        order = np.argsort(-self.node_free, kind="stable")
        chosen, got = [], 0
        for node in order:
            have = int(self.node_free[node])
            if have <= 0:
                break
            take = min(have, need - got)
            chosen.append(self.free_on_node(node, take))
            got += take
            if got == need:
                return np.concatenate(chosen)
        return None

    def find_on_one_node(self, need):
        """Returns `need` free devices on one node (best fit), or None."""
        if need > self.max_node:
            return None
        fits = np.flatnonzero(self.node_free >= need)
        if not fits.size:
            return None
        node = fits[np.argmin(self.node_free[fits])]
        return self.free_on_node(node, need)
