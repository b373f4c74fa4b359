"""Who may reach the dashboard: the host names it answers, and its authentication hook.

* :data:`LOCAL_HOSTS` and :func:`trusted_hosts`: the ``Host`` header of every request
  must name one of the dashboard's own host names (Starlette's
  ``TrustedHostMiddleware``), so a page of another site whose name was made to resolve
  to the dashboard's address (DNS rebinding) gets a 400, not the dashboard;
* :data:`Authenticate`: a hook a host app gives :func:`sqlaq.dashboard.app` to run
  its own authentication on every request; :func:`basic_auth` is the one sqlaq
  provides (HTTP Basic, as ``sqlaq dashboard`` uses with a password set);
* :class:`Guard`: the ASGI middleware that runs the hook.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import inspect
import ipaddress
from collections.abc import Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sqlaq.errors import ConfigError

__all__ = [
    "LOCAL_HOSTS",
    "Authenticate",
    "BasicAuth",
    "Guard",
    "basic_auth",
    "is_local",
    "trusted_hosts",
]

#: The host names a dashboard answers by default: this machine's.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")

#: An authentication hook: called with each request before the dashboard sees it;
#: returns None to let it through, or the response to answer instead (a 401 asking for
#: credentials, a redirect to the host app's login page...). May be a coroutine.
Authenticate = Callable[[Request], Awaitable[Response | None] | Response | None]


def trusted_hosts(names: Iterable[str]) -> list[str]:
    """*names* as ``TrustedHostMiddleware`` matches them: lower case, IPv6 literals in
    brackets (``::1`` -> ``[::1]``, the form of a ``Host`` header). ``*`` lets any
    host through (for a host app that checks the ``Host`` header itself);
    ``*.example.com`` any subdomain.

    Raises:
        ConfigError: an empty name, a name with a port, a path or a space, or a
            wildcard elsewhere than in front.
    """
    found = []
    for raw in names:
        name = raw.strip().lower()
        bare = name.strip("[]")
        if _is_ipv6(bare):
            name = f"[{bare}]"
        elif not name or any(ch in name for ch in "/:[]@ \t") or "*" in name[1:]:
            raise ConfigError(
                f"allowed host {raw!r}: a host name or address without port or path "
                "(localhost, 10.0.0.5, ::1, queue.example.com, *.example.com or *)"
            )
        elif name.startswith("*") and name != "*" and not name.startswith("*."):
            raise ConfigError(f"allowed host {raw!r}: a wildcard is '*.example.com' or '*'")
        if name not in found:
            found.append(name)
    if not found:
        raise ConfigError("allowed hosts: name at least one (or '*' for any)")
    return found


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def is_local(host: str) -> bool:
    """Whether binding to *host* serves this machine only: ``localhost`` or a loopback
    address (``127.0.0.1``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


class BasicAuth:
    """HTTP Basic authentication of one user (see :func:`basic_auth`)."""

    def __init__(self, user: str, password: str, *, realm: str = "sqlaq dashboard") -> None:
        if not user or ":" in user:
            raise ConfigError("dashboard user: a non-empty name without ':'")
        if not password:
            raise ConfigError("dashboard password: empty")
        self._user = user.encode()
        self._password = password.encode()
        self.realm = realm

    def __call__(self, request: Request) -> Response | None:
        """None when *request* carries the user and password, else a 401 asking for
        them (``WWW-Authenticate: Basic``)."""
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                decoded = b""
            user, colon, password = decoded.partition(b":")
            # Both compared in constant time, neither short-circuits the other.
            right_user = hmac.compare_digest(user, self._user)
            right_password = hmac.compare_digest(password, self._password)
            if colon and right_user & right_password:
                return None
        return PlainTextResponse(
            "authentication required",
            status_code=401,
            headers={"www-authenticate": f'Basic realm="{self.realm}", charset="UTF-8"'},
        )


def basic_auth(user: str, password: str, *, realm: str = "sqlaq dashboard") -> BasicAuth:
    """An :data:`Authenticate` hook asking for HTTP Basic credentials: *user* and
    *password* (compared in constant time), else a 401 that makes a browser prompt.

    ``sqlaq.dashboard.app(engine, auth=sqlaq.dashboard.basic_auth("ops", secret))``.
    Basic credentials travel in clear text: serve the dashboard over HTTPS (a proxy in
    front) when it is reached from other machines.

    Raises:
        ConfigError: an empty user or password, or a user holding ``:``.
    """
    return BasicAuth(user, password, realm=realm)


class Guard:
    """ASGI middleware: runs *auth* on every HTTP request and answers with its
    response when it returns one."""

    def __init__(self, inner: ASGIApp, auth: Authenticate) -> None:
        self.inner = inner
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            answer = self.auth(Request(scope, receive))
            if inspect.isawaitable(answer):
                answer = await answer
            if answer is not None:
                await answer(scope, receive, send)
                return
        await self.inner(scope, receive, send)
