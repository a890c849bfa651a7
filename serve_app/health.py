"""What /healthz reports: from the producers' pool statistics and each specialist's status, the problems that
keep an answer from being served by SCD at once (what, why, since when) and the deployment's state."""

import time

from actors.messages import pair_id


def problems(producers: dict, specialists: dict, base: str, grouped: set[str]) -> list[tuple[str, str, float]]:
    """(what, why, since: unix time) for everything that keeps an answer from being served by SCD at once.
    `producers`: the pool's stats by producer name; `specialists`: each specialist's status (or {"error": ...},
    {"busy": ...}); `grouped`: the LoRA groups' members, which need no producer artifact."""
    out, now = [], time.time()
    up = {n: p for n, p in producers.items() if p.get("state") == "up"}
    if not producers:
        out.append(("producers", "the pool has no producer", now))
    for n, p in producers.items():
        if p.get("state") != "up":
            out.append((f"producer {n}", f"{p['state']}: {p.get('error')}", now - p.get("down_for_s", 0.0)))
    seen: dict[str, tuple[str, float]] = {}
    for p in up.values():
        for what, x in (p.get("problems") or {}).items():
            if what not in seen or x["since"] < seen[what][1]:
                seen[what] = (x["reason"], x["since"])
    out += [(what, why, since) for what, (why, since) in sorted(seen.items())]
    for name, st in specialists.items():
        pair = pair_id(base, name)
        if up and not any(pair in p.get("versions", {}) for p in up.values()) and pair not in seen and \
                name not in grouped:
            out.append((pair, "no artifact loaded by the producers: its requests fall back", now))
        if "error" in st or "busy" in st:
            out.append((f"specialist {name}", st.get("error") or st["busy"], now))
        elif st.get("unavailable_reason"):
            out.append((pair, f"specialist {name} serves it by its own prefill: {st['unavailable_reason']}", now))
    return out


def deployment_state(specialists: dict, found: list) -> str:
    """down: no specialist answers its status; degraded: answers come, some by fallback or after a wait; ok."""
    failed = sum("error" in s for s in specialists.values())
    return "down" if failed == len(specialists) else "degraded" if found else "ok"


def problem_lines(found: list[tuple[str, str, float]]) -> list[str]:
    return [f"{what}: {why} (since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(t))})" for what, why, t in found]
