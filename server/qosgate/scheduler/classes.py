"""How the scheduler reads the class list: nested windows per class, the shedding order,
and the window a model starts with. Pure arithmetic on the config."""

from __future__ import annotations

from qosgate.config import GatewayConfig, ModelPolicy

# Where an `auto` dispatch window starts before it has measured anything.
AUTO_WINDOW_START = 8


def initial_window(policy: ModelPolicy) -> int:
    """The window a model starts with: a pinned one, or `auto`'s first guess."""
    if policy.dispatch_window != "auto":
        return policy.dispatch_window
    return min(max(AUTO_WINDOW_START, policy.window_min), policy.window_max)


def class_window(config: GatewayConfig, klass: str, window: int) -> int:
    """Requests in flight below which `klass` may dispatch to a model with `window`: each
    class down the list leaves `window_reserve` more of it to the classes above."""
    rank = config.classes.index(klass)
    lower = len(config.classes) - 1
    if not rank:
        return window
    share = 1.0 - config.scheduler.window_reserve * rank / lower
    return max(1, int(window * share + 1e-9))


def sheddable_classes(config: GatewayConfig) -> list[str]:
    """Sheddable classes, lowest first (the order in which they are shed)."""
    chosen = config.scheduler.sheddable_classes
    if chosen is None:
        chosen = config.classes[1:]
    return sorted(set(chosen), key=config.classes.index, reverse=True)
