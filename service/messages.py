"""What the user reads about a translation that cannot be trusted: warnings and errors, in words."""

from __future__ import annotations

from backends import Translation

# This many equal tokens in a row is flagged: real text rarely repeats a piece 4 times running,
# degenerate decoding ("的的的的…") does.
REPEATED_RUN_FLAG = 4



def _where(indices: list[int], n: int) -> str:
    """' in segments 2, 5' (counted from 1, as the page numbers them); '' for a one-segment input."""
    if n == 1:
        return ""
    shown = ", ".join(str(i + 1) for i in indices[:10])
    more = f" and {len(indices) - 10} more" if len(indices) > 10 else ""
    return f" in segment{'s' if len(indices) > 1 else ''} {shown}{more} of {n}"


def non_finite_error(translations: list[Translation]) -> str | None:
    """The error shown instead of a translation whose logits held NaN or Inf."""
    bad = [i for i, t in enumerate(translations) if t.non_finite_steps]
    if not bad:
        return None
    steps = translations[bad[0]].non_finite_steps  # one: the loop ends a row at its first such step
    more = f" (and {len(bad) - 1} more segments)" if len(bad) > 1 else ""
    return f"non-finite logits (NaN/Inf) at step {steps[0]}{_where(bad[:1], len(translations))}{more}"


def warnings_for(translations: list[Translation]) -> list[str]:
    n, out = len(translations), []
    repeated = [i for i, t in enumerate(translations) if t.repeated_run >= REPEATED_RUN_FLAG]
    if repeated:
        longest = max(translations[i].repeated_run for i in repeated)
        out.append(f"repeated token run of {longest}{_where(repeated, n)}")
    capped = [i for i, t in enumerate(translations) if t.stop_reason != "eos" and not t.non_finite_steps]
    if capped:
        cap = len(translations[capped[0]].token_ids)
        out.append(f"stopped at the {cap}-token cap before eos{_where(capped, n)}")
    return out
