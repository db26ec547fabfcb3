"""A watcher that hears a notice first: it polls the notice sources in a thread of the role's process.

Off a cloud (a laptop, CI) the first short probe finds nothing and the watcher stops asking, from its own thread:
start-up never waits for it. What each source is: `contracts.notice_sources`; what a notice is: `contracts.notices`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from contracts.notice_sources import NoticeFile, cloud_sources
from contracts.notices import GCP_NOTICE_S, Notice

log = logging.getLogger("spotrl.notices")


class NoticeWatcher:
    """Polls the notice sources every `interval_s` in a daemon thread and calls each handler once per notice.

    A binding notice (an interruption) is reported once, and the watcher then polls nothing more (the machine is
    going) until the role says the node outlived it (`clear`); a recommendation (AWS rebalance) is reported once, and
    the watcher goes on watching for the interruption itself. A source that fails (a metadata server that
    errs, Ray's GCS out of reach) is logged and asked again later, backing off, never the end of watching the
    others or itself. `sigterm_grace_s` makes a SIGTERM to this process a notice with
    that deadline (installed only from the main thread; the previous handler still runs after ours, so what
    SIGTERM did before, it still does; with `chain_sigterm` False only on a second SIGTERM, so that a process that
    must checkpoint first, the learner, lives on until the grace period ends)."""

    def __init__(
        self,
        handlers: list[Callable[[Notice], None]],
        *,
        interval_s: float = 5.0,
        probe_timeout_s: float = 1.0,
        notice_file: str | None = None,
        sources: list | None = None,
        sigterm_grace_s: float | None = None,
        chain_sigterm: bool = True,
    ):
        self.handlers = list(handlers)
        self.interval_s = interval_s
        self.sources = cloud_sources(probe_timeout_s, interval_s) if sources is None else list(sources)
        if notice_file:
            self.sources.append(NoticeFile(notice_file, sigterm_grace_s or GCP_NOTICE_S))
        self.notices: list[Notice] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `stop` and `clear`: the thread looks again at once
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="spot-notices", daemon=True)
        if sigterm_grace_s is not None:
            self._install_sigterm(sigterm_grace_s, chain_sigterm)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def binding(self) -> Notice | None:
        """The interruption notice, once one came."""
        return next((n for n in self.notices if n.binding), None)

    def clear(self, notice: Notice) -> None:
        """The node outlived `notice` (the machine was not taken after all): watch for the next one."""
        with self._lock:
            self.notices = [n for n in self.notices if n is not notice]
        self._wake.set()

    def _install_sigterm(self, grace_s: float, chain: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            notice = Notice("sigterm", time.time() + grace_s, f"SIGTERM, {grace_s:.0f} s grace")
            if not chain:
                # The process lives on to act on it (its handlers make RPCs: not from inside a signal handler); a
                # second SIGTERM, or the grace period's SIGKILL, ends it.
                if self.binding is not None and callable(previous):
                    previous(signum, frame)
                threading.Thread(target=self.report, args=(notice,), name="spot-sigterm", daemon=True).start()
                return
            self.report(notice)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def report(self, notice: Notice) -> None:
        """Hand `notice` to every handler, unless a notice of its kind (binding or not) came already."""
        with self._lock:
            if any(n.binding == notice.binding for n in self.notices):
                return
            self.notices.append(notice)
        log.warning("spot: %s", notice.describe())
        for handler in self.handlers:
            try:
                handler(notice)
            except Exception:  # noqa: BLE001 - one role's failure must not keep the others from acting
                log.exception("spot: a notice handler failed")

    def _watch(self) -> None:
        live = [s for s in self.sources if self._answers(s)]
        if not live:
            log.info("spot: no metadata service or notice file answers here; not watching")
        failing = {source: _Failing() for source in live}
        while live and not self._stop.is_set():
            if self.binding is None:
                for source in live:
                    self._poll(source, failing[source])
            # Nothing to poll for while the machine is going: woken by `clear` (it stayed) or `stop`.
            self._wake.wait(self.interval_s if self.binding is None else None)
            self._wake.clear()
        for source in self.sources:
            source.close()

    def _poll(self, source, failing: _Failing) -> None:
        if not failing.due():
            return
        try:
            notice = source.poll()
        except Exception as e:  # noqa: BLE001 - a source that errs is asked again later, never the end of watching
            failing.failed(source.name, e, self.interval_s)
            return
        failing.answered(source.name)
        if notice is not None:
            self.report(notice)

    @staticmethod
    def _answers(source) -> bool:
        try:
            return source.probe()
        except Exception:  # noqa: BLE001 - whatever a source fails with at the first probe, it is not here
            return False


MAX_BACKOFF_S = 60.0


class _Failing:
    """A source's consecutive failures: asked again after the poll interval, doubled per failure (at most
    `MAX_BACKOFF_S`); the first failure and the recovery are logged."""

    def __init__(self):
        self.failures, self.next_at = 0, 0.0

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def failed(self, name: str, error: Exception, interval_s: float) -> None:
        self.failures += 1
        pause = min(interval_s * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        self.next_at = time.monotonic() + pause
        say = log.warning if self.failures == 1 else log.debug
        say(
            "spot: the %s notice source failed (%s: %s); asking again in %.0f s",
            name,
            type(error).__name__,
            error,
            pause,
        )

    def answered(self, name: str) -> None:
        if self.failures:
            log.warning("spot: the %s notice source answers again after %d failures", name, self.failures)
        self.failures, self.next_at = 0, 0.0
