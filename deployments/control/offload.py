"""A few worker threads for the ingress's blocking work, so that its event loop only ever waits on I/O.

One event loop answers every request of the fleet, `/health` included: a large prompt to tokenize, a body to
parse or a bucket call (a run's record) on it would stall them all. HF fast tokenizers release the GIL while
they encode, and are safe to share between threads as the ingress uses them (no per-call truncation or
padding changes).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# A few threads: one large prompt neither blocks the event loop nor queues every other request behind it.
_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spotrl-ingress")


# Work this small costs the event loop less than its trip to a worker thread and back, which also waits for the GIL
# (up to its 5 ms switch interval while the loop is busy, as it is under a burst of requests): a body of a few KiB
# parses, and a few hundred tokens are checked or answered, in tens of microseconds (bench/request_shapes.py).
INLINE_BODY_BYTES = 16 * 1024
INLINE_TOKENS = 2048


async def offload(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args))


async def offload_unless_small(small: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the event loop if the work is `small` (by `INLINE_BODY_BYTES` or `INLINE_TOKENS`), else
    `offload`ed."""
    return fn(*args) if small else await offload(fn, *args)
