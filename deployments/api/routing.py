"""Handlers as methods: a class of routes per job, each method marked with the verb and path it answers.

A class holds what its handlers share (the callers, the backend, the control layer's objects), so a handler
reads as the call it answers and nothing else; `Routes.register` adds every marked method to the app.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI

Handler = TypeVar("Handler", bound=Callable[..., Any])


def route(verb: str, path: str) -> Callable[[Handler], Handler]:
    """Mark a method of a `Routes` class as the handler of `verb path`."""

    def mark(handler: Handler) -> Handler:
        handler.route = (verb, path)
        return handler

    return mark


class Routes:
    """A set of handlers, registered on an app together, in the order they are defined (a path that matches what
    follows it, `{name:path}`, is defined after the routes under it: the first route that matches answers)."""

    def register(self, app: FastAPI) -> None:
        names = dict.fromkeys(name for cls in reversed(type(self).__mro__) for name in vars(cls))
        for name in names:
            handler = getattr(self, name)
            if hasattr(handler, "route"):
                verb, path = handler.route
                app.add_api_route(path, handler, methods=[verb], response_model=None)
