"""Request body limit, enforced while the body streams in (before multipart parsing spools it).

A declared Content-Length over the limit is refused at once; a chunked body is counted and cut
off with BodyTooLarge the moment it passes the limit. The upload route enforces the exact
per-file limit itself; this bounds what reaches the parser.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_response

MULTIPART_SLACK = 64 * 1024  # boundaries, part headers, the purpose field


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


def too_large_response(limit: int):  # type: ignore[no-untyped-def]
    return error_response(413, f"The request body is larger than the limit of {limit} bytes (MAX_UPLOAD_BYTES). "
                               "Split the file, or raise MAX_UPLOAD_BYTES on the server.",
                          code="file_too_large", param="file")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_upload_bytes: int, max_json_bytes: int = 1024 * 1024) -> None:
        self.app, self.upload_limit, self.json_limit = app, max_upload_bytes, max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        is_upload = scope["path"].rstrip("/").endswith("/files")
        limit = self.upload_limit + MULTIPART_SLACK if is_upload else self.json_limit
        shown = self.upload_limit if is_upload else self.json_limit
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _drain_and_refuse(shown, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(shown)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge as exc:
            await too_large_response(exc.limit)(scope, receive, send)


async def _drain_and_refuse(limit: int, send: Send) -> None:
    response = too_large_response(limit)
    response.headers["Connection"] = "close"
    await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}

