"""How often the popular-prefix rule fires on `bench live`'s groups workload by chance.

Six documents x eight questions, shuffled, over four endpoints and K router replicas (each
request to one at random): every question after its document's first is a new session drawn
by the document, and a document that draws more than one endpoint's share is spread. Its
true share is 1/6, under 1/4, so every spread is a false alarm. Prints, per rule, the mean
spreads per shuffle and the share of shuffles with at least one (4,000 shuffles). Decay over
the 256-session window is ignored (48 sessions).

    python docs/tried-popularity-significance/shuffles.py
"""

from __future__ import annotations

import math
import random

MIN_NEW_SESSIONS = 16  # extproc/popularity.py


def spreads(
    routers: int,
    z: float | None,
    endpoints: int = 4,
    groups: int = 6,
    questions: int = 8,
    trials: int = 4000,
) -> tuple[float, float]:
    total = shuffles_with_one = 0
    for trial in range(trials):
        rng = random.Random(trial)
        order = [g for g in range(groups) for _ in range(questions)]
        rng.shuffle(order)
        state = [({}, set(), [0]) for _ in range(routers)]
        fired = 0
        for group in order:
            counts, seen, sessions = state[rng.randrange(routers)]
            sessions[0] += 1
            held = group in seen
            seen.add(group)
            counts[group] = counts.get(group, 0) + 1
            count, n = counts[group], sessions[0]
            if z is None:  # the shipped rule: share over at least MIN_NEW_SESSIONS
                popular = count / max(n, MIN_NEW_SESSIONS) * endpoints > 1 + 1e-9
            else:  # beyond chance by z standard deviations
                p = 1 / endpoints
                popular = count > n * p + z * math.sqrt(n * p * (1 - p))
            fired += popular and held
        total += fired
        shuffles_with_one += fired > 0
    return total / trials, shuffles_with_one / trials


if __name__ == "__main__":
    for routers in (1, 2):
        for z in (None, 1.0, 1.5, 2.0, 2.5, 3.0):
            mean, share = spreads(routers, z)
            rule = "shipped" if z is None else f"z={z}"
            print(f"K={routers} {rule:>8}: {mean:.2f} spreads per shuffle, {share:.1%} with any")
