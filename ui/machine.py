"""How busy the machine was while something was timed, said next to the timings."""

from __future__ import annotations


def load_warning(env: dict) -> str:
    """A warning when the 1-minute load average exceeded the cores: other work competed for the CPU.

    The load average lags (it is a 1-minute mean), so it is read at the start and at the end and the
    higher one counts. Empty when the machine was no busier than its cores.
    """
    cores = env.get("logical_cores") or 0
    seen = [x for x in (env.get("load_average_1m_at_start"), env.get("load_average_1m_at_end")) if x is not None]
    if not cores or not seen or max(seen) <= cores:
        return ""
    return (
        f"⚠️ The load average reached {max(seen):.1f} on {cores} cores: other processes competed for the CPU "
        "during this run, so these timings are inflated and noisy, and ratios between backends timed at "
        "different moments are unreliable."
    )
