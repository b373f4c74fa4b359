"""CSRF protection of the dashboard's actions: a signed double-submit token, and a
same-origin check of every POST.

Every page sets a cookie holding a token the dashboard issued unless the browser has
one, and every form carries the same token in a hidden field. A token is a random nonce
and its HMAC-SHA256 under the dashboard's secret (random per process, or the one given
to :func:`sqlaq.dashboard.app` so that several processes accept each other's): a
cookie the dashboard never issued, one another site planted through a sibling domain
say, is not accepted. A POST is accepted only when

* the browser does not say it comes from another site (``Sec-Fetch-Site`` is
  ``cross-site`` or ``same-site``), and its ``Origin``, when sent, names the host the
  request was sent to (its ``Host``, port included);
* both the cookie and the field are present, equal (compared in constant time) and
  signed by the dashboard.

Another site can make a browser send the cookie, but cannot read it to fill in the
field. The cookie is ``SameSite=Strict`` and ``HttpOnly``, scoped to the dashboard's
path (its mount point in a host's app), and ``Secure`` when the page was served over
HTTPS.

Starlette has no CSRF protection of its own; the maintained middlewares add a
dependency for these lines.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from sqlaq.errors import ConfigError

__all__ = ["COOKIE", "FIELD", "MIN_SECRET_BYTES", "CsrfError", "Tokens", "set_cookie"]

#: The cookie and the form field that carry the token.
COOKIE = "sqlaq_csrf"
#: The form field that carries the token (the cookie is :data:`COOKIE`).
FIELD = "csrf_token"
#: The shortest secret :class:`Tokens` takes.
MIN_SECRET_BYTES = 16
_DEFAULT_PORTS = {"http": "80", "https": "443"}


class CsrfError(Exception):
    """A POST without the page's token, or from another site (answered 403)."""


class Tokens:
    """Issues and checks the tokens of one dashboard, signed with its *secret*.

    Args:
        secret: The HMAC key, at least :data:`MIN_SECRET_BYTES` bytes (text is taken as
            UTF-8); None draws a random one, good for this process only.

    Raises:
        ConfigError: the secret is too short.
    """

    def __init__(self, secret: bytes | str | None = None) -> None:
        key = secret.encode() if isinstance(secret, str) else secret
        if key is None:
            key = secrets.token_bytes(32)
        if len(key) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"csrf_secret: at least {MIN_SECRET_BYTES} bytes, got {len(key)}: "
                "use secrets.token_urlsafe(32)"
            )
        self._key = key

    def _sign(self, nonce: str) -> str:
        digest = hmac.new(self._key, nonce.encode("ascii"), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def new(self) -> str:
        """A fresh token: ``<nonce>.<signature>``."""
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{self._sign(nonce)}"

    def valid(self, value: str) -> bool:
        """Whether *value* is a token this dashboard issued (signed with its secret)."""
        nonce, dot, signature = value.partition(".")
        if not dot or not nonce.isascii() or not signature.isascii():
            return False
        return hmac.compare_digest(signature.encode(), self._sign(nonce).encode())

    def issue(self, request: Request) -> str:
        """The browser's token if the dashboard issued it, else a new one (for
        :func:`set_cookie`)."""
        given = request.cookies.get(COOKIE, "")
        return given if self.valid(given) else self.new()

    def check(self, request: Request, submitted: object) -> None:
        """Accept a POST from the dashboard's own page whose form field *submitted*
        matches the cookie, both issued by this dashboard.

        Raises:
            CsrfError: a cross-site or cross-origin request; no cookie, no field, a
                mismatch, or a token the dashboard did not issue.
        """
        refused = cross_site(request)
        if refused:
            raise CsrfError(refused)
        cookie = request.cookies.get(COOKIE)
        if not cookie or not isinstance(submitted, str) or not submitted:
            raise CsrfError("missing CSRF token: reload the page and try again")
        same = hmac.compare_digest(
            cookie.encode("utf-8", "replace"), submitted.encode("utf-8", "replace")
        )
        if not same or not self.valid(cookie):
            raise CsrfError("CSRF token mismatch: reload the page and try again")


def cross_site(request: Request) -> str | None:
    """Why *request* looks sent by another site's page, or None.

    ``Sec-Fetch-Site: cross-site`` or ``same-site`` (a sibling domain, or another port
    of the same host), an ``Origin`` of ``null``, or an ``Origin`` whose host and port
    differ from the ``Host`` header. Clients that send neither header (curl, scripts)
    pass: they carry no browser's cookies.
    """
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site in ("cross-site", "same-site"):
        return f"cross-site request refused (Sec-Fetch-Site: {fetch_site})"
    origin = request.headers.get("origin")
    if origin is None:
        return None
    host = request.headers.get("host", "")
    sender = _authority(origin)
    if sender is None or sender != _host_and_port(host, scheme=urlsplit(origin).scheme):
        return f"cross-site request refused: Origin {origin[:100]!r} is not {host[:100]!r}"
    return None


def _authority(origin: str) -> tuple[str, str] | None:
    """``(host, port)`` of an Origin (the default port of its scheme when it has
    none); None for ``null`` or anything not an http(s) origin."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return parts.hostname, str(port) if port is not None else _DEFAULT_PORTS[parts.scheme]


def _host_and_port(host: str, *, scheme: str) -> tuple[str, str] | None:
    """``(host, port)`` of a Host header, with *scheme*'s default port when it names
    none (a browser leaves the default port out of both headers)."""
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    return _authority(f"{scheme}://{host}")


def set_cookie(response: Response, request: Request, value: str) -> None:
    """Store *value* in the browser, for the dashboard's path only."""
    response.set_cookie(
        COOKIE,
        value,
        path=request.scope.get("root_path") or "/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
