"""The API documentation pages (/docs, /redoc) and the favicon, served offline.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, which leaves `/docs` blank
on the air-gapped and on-premises hosts the service runs on. Here the same pages
load the assets from vitrieval itself: the files ship in the `fastapi-offline`
package (a dependency of the `serve` extra) and are served by the routes below, so
the HTML names no external host.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import FileResponse, HTMLResponse, Response

from ..errors import ApiError

router = APIRouter(include_in_schema=False)

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
ASSETS_URL = "/docs/assets"
_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
}


@lru_cache
def _assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


@lru_cache
def _favicon() -> bytes:
    return files("vitrieval.service").joinpath("static/favicon.svg").read_bytes()


def _docs_page(request: Request, render: Callable[..., HTMLResponse], **urls: str) -> HTMLResponse:
    """The page `render` (FastAPI's Swagger UI or ReDoc) makes for this app; `urls`
    are paths below the root path the service is mounted at, as the OpenAPI one is."""
    root = request.scope.get("root_path", "").rstrip("/")
    return render(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title}: API",
        **{name: f"{root}{path}" for name, path in urls.items()},
    )


@router.get(DOCS_URL)
async def swagger_ui(request: Request) -> HTMLResponse:
    return _docs_page(
        request,
        get_swagger_ui_html,
        swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url="/favicon.svg",
        oauth2_redirect_url=OAUTH2_REDIRECT_URL,
    )


@router.get(OAUTH2_REDIRECT_URL)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get(REDOC_URL)
async def redoc(request: Request) -> HTMLResponse:
    return _docs_page(
        request,
        partial(get_redoc_html, with_google_fonts=False),
        redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
        redoc_favicon_url="/favicon.svg",
    )


@router.get(ASSETS_URL + "/{name}")
async def asset(name: str) -> FileResponse:
    if name not in _ASSETS:
        raise ApiError(404, "not_found", f"no documentation asset {name!r}")
    return FileResponse(
        _assets_dir() / name,
        media_type=_ASSETS[name],
        headers={"Cache-Control": "max-age=86400"},
    )


@router.get("/favicon.svg")
@router.get("/favicon.ico")
async def favicon() -> Response:
    return Response(
        _favicon(), media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"}
    )
