"""Placement names in a config, checked by Ray's own rules (ray._private.label_utils, Kubernetes label syntax),
so that a typo is a config error naming its path instead of an actor that never schedules."""
from __future__ import annotations

import re

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^({_LABEL}(\.{_LABEL})*/)?{_LABEL}$")
_LABEL_SELECTOR = re.compile(rf"^!?{_LABEL}$|^!?(in)?\({_LABEL}(, ?{_LABEL})*\)$")
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
_RAY_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": None, "object_store_memory": None}


def check_resources(v: dict[str, float]) -> dict[str, float]:
    """Custom resources {name: amount} as given, or a ValueError naming every bad one: Ray's own resources, a
    node's address, a name Ray refuses, an amount below Ray's smallest unit."""
    bad = []
    for name, amount in v.items():
        if name in _RAY_RESOURCES:
            use = _RAY_RESOURCES[name]
            bad.append(f"{name!r} is Ray's own resource" + (f"; use {use}" if use else ""))
        elif name.startswith("node:"):
            bad.append(f"{name!r} pins one node by address and cannot move when it fails; use node_labels")
        elif not _RESOURCE.match(name):
            bad.append(f"{name!r} is not a resource name (letters, digits, _ . : -; a letter or _ first)")
        elif not amount >= 1e-4:
            bad.append(f"{name!r}: amount {amount} must be positive (at least 0.0001)")
    if bad:
        raise ValueError("; ".join(bad))
    return v


def check_labels(v: dict[str, str]) -> dict[str, str]:
    """A label selector {key: value} as given, or a ValueError naming every bad key and value."""
    bad = []
    for key, value in v.items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63 or len(prefix) > 253 or not _LABEL_KEY.match(key):
            bad.append(f"label key {key!r} is not [prefix/]name (name: 63 characters or less, alphanumeric "
                       f"at both ends, - _ . inside; prefix: dot-separated names)")
        elif not _LABEL_SELECTOR.match(value):
            bad.append(f"{key}: {value!r} is not a label selector value (v, !v, in(a,b) or !in(a,b); each "
                       f"value alphanumeric at both ends, - _ . inside)")
    if bad:
        raise ValueError("; ".join(bad))
    return v
