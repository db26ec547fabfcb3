"""Handlers as methods: a class of routes per job, each method marked with the verb and path it answers.

A class holds what its handlers share (the callers, the backend, the control layer's objects), so a handler
reads as the call it answers and nothing else; `Routes.register` adds every marked method to the app.

A fleet's own routes (`fleet.routes`: `module:callable` names, each taking the app's `RouteParts` and returning a
`Routes`) are found here by name, once by the fleet's builder (a name that does not import fails the deployment
before anything starts) and again by the ingress (docs/extending.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
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

    def handlers(self) -> list[tuple[str, str, Callable[..., Any]]]:
        """(verb, path, handler) of every marked method, in the order the classes define them."""
        names = dict.fromkeys(name for cls in reversed(type(self).__mro__) for name in vars(cls))
        marked = [getattr(self, name) for name in names if hasattr(getattr(self, name), "route")]
        return [(*handler.route, handler) for handler in marked]

    def register(self, app: FastAPI) -> None:
        for verb, path, handler in self.handlers():
            app.add_api_route(path, handler, methods=[verb], response_model=None)


def route_factories(names: Sequence[str]) -> list[Callable[..., Routes]]:
    """The callables `fleet.routes` names (`module:callable`), each making a `Routes` from the app's `RouteParts`;
    ValueError naming the one that does not import."""
    factories = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"fleet.routes: {name!r} cannot be imported: {e}") from None
        if not callable(factory):
            raise ValueError(f"fleet.routes: {name!r} is not callable")
        factories.append(factory)
    return factories
