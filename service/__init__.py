"""The request layer between the UI (and the API) and the engines in `backends/`.

It knows no screen: input checks, limits and deadlines (`limits`), sentence splitting
(`segment`), running backends one after another and comparing them with the reference, with the
`compare` API's JSON contract (`compare`), the warnings a user reads (`messages`), and the
spot-check and quick-benchmark runs the app's tabs start. `ui/` and `app.py` import this package,
never `bench/`; `bench/` may use it too. Importing it loads no model and no torch.
"""

from __future__ import annotations

from backends import InputError

from .compare import BackendResult, compare, compare_iter, decoding_json, segments_json, to_json
from .limits import MAX_REPEAT, RequestLimits, TimeLimitExceeded, decoding_for, plan

__all__ = [
    "MAX_REPEAT",
    "BackendResult",
    "InputError",
    "RequestLimits",
    "TimeLimitExceeded",
    "compare",
    "compare_iter",
    "decoding_for",
    "decoding_json",
    "plan",
    "segments_json",
    "to_json",
]
