"""``GET /`` (the page) and ``GET /dashboard/static/{path}`` (its scripts, styles, vendored uPlot).

Only the files shipped in ``static/`` are served, looked up in a table built at import, so no
request path can reach outside the directory.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from service.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
               ".LICENSE": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
# The page talks only to this origin; uPlot sets inline styles, hence 'unsafe-inline' for style-src.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _static_files() -> dict[str, Path]:
    return {p.relative_to(STATIC_DIR).as_posix(): p for p in STATIC_DIR.rglob("*")
            if p.is_file() and p.suffix in MEDIA_TYPES and p.name != "index.html"}


STATIC_FILES = _static_files()
router = APIRouter(include_in_schema=False)


def _file(path: Path) -> FileResponse:
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS)


@router.get("/")
def dashboard() -> FileResponse:
    return _file(STATIC_DIR / "index.html")


@router.get("/dashboard/static/{path:path}")
def dashboard_static(path: str) -> FileResponse:
    file = STATIC_FILES.get(path)
    if file is None:
        raise APIError(404, f"No dashboard file {path!r}.", code="not_found")
    return _file(file)
