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


async def offload(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args))
