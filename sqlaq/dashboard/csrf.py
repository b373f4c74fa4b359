"""CSRF protection of the dashboard's actions: a double-submit token.

Every page sets a cookie holding a random token (``secrets.token_urlsafe``) unless the
browser has one, and every form carries the same token in a hidden field. A POST is
accepted only when both are present and equal (compared in constant time), and when the
browser does not say it comes from another site (``Sec-Fetch-Site: cross-site``). Another
site can make a browser send the cookie, but cannot read it to fill in the field. The
cookie is ``SameSite=Strict`` and ``HttpOnly``, scoped to the dashboard's path (its mount
point in a host's app), and ``Secure`` when the page was served over HTTPS.

Starlette has no CSRF protection of its own; the maintained middlewares add a
dependency for these thirty lines.
"""

from __future__ import annotations

import hmac
import secrets

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["COOKIE", "FIELD", "CsrfError", "check", "set_cookie", "token"]

#: The cookie and the form field that carry the token.
COOKIE = "sqlaq_csrf"
#: The form field that carries the token (the cookie is :data:`COOKIE`).
FIELD = "csrf_token"
_LENGTH = 43  # token_urlsafe(32)


class CsrfError(Exception):
    """A POST without the page's token, or from another site (answered 403)."""


def token(request: Request) -> str:
    """The browser's token if it sent a well-formed one, else a new one (for
    :func:`set_cookie`)."""
    given = request.cookies.get(COOKIE, "")
    if len(given) == _LENGTH and given.replace("-", "").replace("_", "").isalnum():
        return given
    return secrets.token_urlsafe(32)


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


def check(request: Request, submitted: object) -> None:
    """Accept a POST whose form field *submitted* matches the cookie.

    Raises:
        CsrfError: no cookie, no field, a mismatch, or a cross-site request.
    """
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise CsrfError("cross-site request refused")
    cookie = request.cookies.get(COOKIE)
    if not cookie or not isinstance(submitted, str) or not submitted:
        raise CsrfError("missing CSRF token: reload the page and try again")
    if not hmac.compare_digest(
        cookie.encode("utf-8", "replace"), submitted.encode("utf-8", "replace")
    ):
        raise CsrfError("CSRF token mismatch: reload the page and try again")
