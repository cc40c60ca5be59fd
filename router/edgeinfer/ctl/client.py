"""The router's admin API as seen from ``edgectl``: one blocking JSON call per method.

Blocking ``urllib`` rather than aiohttp: edgectl makes a handful of sequential calls and exits,
so an event loop would add start-up time and nothing else. Every failure becomes a
:class:`RouterClientError` whose message is the single line edgectl prints.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from edgeinfer.shared.errors import EdgeInferError

DEFAULT_ROUTER = "http://127.0.0.1:8080"

F = TypeVar("F", bound=Callable[..., Any])


class RouterClientError(EdgeInferError):
    """The router could not be reached or refused the call; the message is for the operator."""


# Where edgectl's own --router/--token (given before the command) wait for the command.
_BEFORE_COMMAND = "edgectl.before_command."


def router_options(func: F) -> F:
    """``--router`` and ``--token``, shared by every command that talks to a router.

    Either may come after the command or before it (``edgectl --router URL drain POP``, as
    kubectl takes its global flags, see :func:`global_router_options`); the command's own flag
    wins, then the one before it, then the environment, then the default.
    """
    func = click.option(
        "--token",
        envvar="EDGEINFER_ADMIN_TOKEN",
        show_envvar=True,
        callback=_after_command_first,
        help="Admin bearer token of the router.",
    )(func)
    return click.option(
        "--router",
        "router_url",
        envvar="EDGEINFER_ROUTER",
        show_envvar=True,
        default=DEFAULT_ROUTER,
        show_default=True,
        callback=_after_command_first,
        help="Base URL of the router.",
    )(func)


def global_router_options(func: F) -> F:
    """``--router`` and ``--token`` on edgectl itself, for the commands that take them."""
    func = click.option(
        "--token",
        expose_value=False,
        callback=_keep_for_command,
        help="Admin bearer token, for the commands that talk to a router.",
    )(func)
    return click.option(
        "--router",
        "router_url",
        expose_value=False,
        callback=_keep_for_command,
        help="Base URL of the router, for the commands that talk to one.",
    )(func)


def _keep_for_command(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.meta[_BEFORE_COMMAND + str(param.name)] = value


def _after_command_first(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if ctx.get_parameter_source(str(param.name)) is ParameterSource.COMMANDLINE:
        return value
    return ctx.meta.get(_BEFORE_COMMAND + str(param.name), value)


@dataclass(frozen=True)
class AdminClient:
    router_url: str
    token: str | None
    timeout_s: float = 10.0

    def pops(self) -> dict[str, Any]:
        return self._call("GET", "/admin/pops")

    def pop(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/admin/pops/{_segment(name)}")

    def drain_pop(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/pops/{_segment(name)}/drain")

    def undrain_pop(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/pops/{_segment(name)}/undrain")

    def _call(self, method: str, path: str) -> dict[str, Any]:
        if not self.token:
            raise RouterClientError("no admin token: pass --token or set EDGEINFER_ADMIN_TOKEN")
        url = self.router_url.rstrip("/") + path
        req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return _json_object(resp.read(), url)
        except urllib.error.HTTPError as e:
            raise RouterClientError(_http_error_line(e, self.router_url)) from e
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or e.reason
            raise RouterClientError(f"cannot reach router at {self.router_url}: {reason}") from e
        except TimeoutError as e:
            raise RouterClientError(
                f"router at {self.router_url} did not answer within {self.timeout_s:g}s"
            ) from e
        except (ConnectionError, ValueError) as e:
            # ValueError: a --router that is not an http URL at all.
            raise RouterClientError(f"cannot reach router at {self.router_url}: {e}") from e


def _segment(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _json_object(raw: bytes, url: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RouterClientError(f"{url} did not answer JSON: is this an edge-router?") from e
    if not isinstance(body, dict):
        raise RouterClientError(f"{url} answered {type(body).__name__}, expected an object")
    return body


def _http_error_line(e: urllib.error.HTTPError, router_url: str) -> str:
    try:
        message = json.loads(e.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        message = e.reason
    if e.code == 401:
        return f"router at {router_url} refused the admin token (check --token)"
    return f"{message} (HTTP {e.code})"
